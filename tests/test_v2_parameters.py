"""The v2 inference parameters, served: the binary tensor data extension's flags are JSON booleans,
read the same way for an embedding model and a classifier; a wrong type (the string "false"
included) is a 422 that names the parameter; binary inputs are read from their own slices of the
binary tail, whichever inputs come as JSON."""

from __future__ import annotations

import json
import struct

import httpx
import numpy as np
import pytest

from tests.conftest import deploy

INFER = "/v2/models/all-MiniLM-L6-v2/infer"
TEXTS = ["the first text", "a second, longer text than the first one"]
OUTPUTS = ["sentence_embedding", "attention_mask"]
PREFIX = "/v2params"
RANKER = "/v2/models/ranker/infer"
QUERIES = ["how do I reset my password", "opening hours"]
DOCUMENTS = ["click forgot password on the sign in page", "the museum is closed on mondays"]
_DTYPES = {"FP32": "<f4", "INT64": "<i8"}


@pytest.fixture(scope="module")
def client(service_url):
    with httpx.Client(base_url=service_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def ranker(ray_serve, default_bundle, exported_classifier):
    """A one-label BERT cross-encoder (tests/families.py; the session's export, tests/conftest.py),
    served alone at PREFIX."""
    _, bundle = exported_classifier("ranker")
    deploy({"bundles": [{"path": str(bundle), "name": "ranker"}], "num_cpus": 0.5}, "v2params", PREFIX,
           default_bundle)
    try:
        with httpx.Client(base_url=ray_serve.url + PREFIX, timeout=60) as c:
            yield c
    finally:
        from ray import serve

        serve.delete("v2params")


def json_input(name: str, texts: list[str], **parameters) -> dict:
    tensor = {"name": name, "shape": [len(texts)], "datatype": "BYTES", "data": texts}
    return {**tensor, "parameters": parameters} if parameters else tensor


def length_prefixed(texts: list[str]) -> bytes:
    """BYTES elements as the binary extension sends them: a 4-byte little-endian length, then UTF-8."""
    return b"".join(struct.pack("<I", len(t.encode())) + t.encode() for t in texts)


def binary_input(name: str, texts: list[str]) -> tuple[dict, bytes]:
    data = length_prefixed(texts)
    return {"name": name, "shape": [len(texts)], "datatype": "BYTES", "parameters": {"binary_data_size": len(data)}}, data


def post_binary(c: httpx.Client, path: str, header: dict, tail: bytes, header_len: int | None = None) -> httpx.Response:
    """A body as tritonclient sends one: the JSON header, then the binary tail."""
    head = json.dumps(header).encode()
    return c.post(path, content=head + tail, headers={"Inference-Header-Content-Length": str(header_len or len(head))})


def read_outputs(r: httpx.Response) -> tuple[dict[str, np.ndarray], set[str]]:
    """Every output as an array, and the names of those that came as binary data."""
    assert r.status_code == 200, r.text
    header_len = int(r.headers.get("inference-header-content-length", len(r.content)))
    body, tail, at = json.loads(r.content[:header_len]), r.content[header_len:], 0
    arrays, binary = {}, set()
    for out in body["outputs"]:
        dtype = _DTYPES[out["datatype"]]
        if "data" in out:
            arrays[out["name"]] = np.array(out["data"], dtype=dtype).reshape(out["shape"])
            continue
        size = out["parameters"]["binary_data_size"]
        arrays[out["name"]] = np.frombuffer(tail[at : at + size], dtype=dtype).reshape(out["shape"])
        binary.add(out["name"])
        at += size
    assert at == len(tail), "the binary tail holds exactly the binary outputs"
    return arrays, binary


def assert_error_names(r: httpx.Response, status: int, words: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()  # KServe's {"error": message}, our type and the request's id beside it
    assert set(body) == {"error", "type", "request_id"} and words in body["error"], body
    assert body["request_id"] == r.headers["x-request-id"]


def text_request(**extra) -> dict:
    return {"inputs": [json_input("text", TEXTS)], **extra}


WRONG_TYPES = [
    ("binary_data_output as the string false", text_request(parameters={"binary_data_output": "false"}),
     "parameters.binary_data_output"),
    ("binary_data_output as the string true", text_request(parameters={"binary_data_output": "true"}),
     "parameters.binary_data_output"),
    ("binary_data_output as a number", text_request(parameters={"binary_data_output": 1}), "parameters.binary_data_output"),
    ("an output's binary_data as the string false",
     text_request(outputs=[{"name": "sentence_embedding", "parameters": {"binary_data": "false"}}]),
     "outputs.0.parameters.binary_data"),
    ("the second output's binary_data as a number",
     text_request(outputs=[{"name": "sentence_embedding"}, {"name": "attention_mask", "parameters": {"binary_data": 0}}]),
     "outputs.1.parameters.binary_data"),
    ("truncate as the string false", text_request(parameters={"truncate": "false"}), "parameters.truncate"),
    ("binary_data_size as a boolean",
     {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": True}}]},
     "inputs.0.parameters.binary_data_size"),
    ("binary_data_size as a string",
     {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": "5"}}]},
     "inputs.0.parameters.binary_data_size"),
    ("binary_data_size negative",
     {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": -1}}]},
     "inputs.0.parameters.binary_data_size"),
]


@pytest.mark.parametrize(("body", "parameter"), [w[1:] for w in WRONG_TYPES], ids=[w[0] for w in WRONG_TYPES])
def test_a_wrongly_typed_v2_parameter_is_a_422_naming_it(client, body, parameter):
    """The spec's booleans are JSON booleans (tritonclient sends them so): "false" is not read as true."""
    assert_error_names(client.post(INFER, json=body), 422, parameter)


def test_binary_data_output_false_is_json_and_true_is_binary(client):
    as_json, json_binary = read_outputs(client.post(INFER, json=text_request(parameters={"binary_data_output": False})))
    r = client.post(INFER, json=text_request(parameters={"binary_data_output": True}))
    as_binary, binary = read_outputs(r)
    assert json_binary == set() and binary == {"sentence_embedding", "last_hidden_state", "attention_mask"}
    assert r.headers["content-type"] == "application/octet-stream"
    for name, array in as_json.items():
        np.testing.assert_allclose(as_binary[name], array, atol=1e-6)
    assert as_json["attention_mask"].sum(1).tolist()[0] < as_json["attention_mask"].sum(1).tolist()[1]


def test_an_outputs_own_binary_data_decides_over_the_requests_flag(client):
    outputs = [{"name": "sentence_embedding", "parameters": {"binary_data": False}}, {"name": "attention_mask"}]
    _, binary = read_outputs(client.post(INFER, json=text_request(parameters={"binary_data_output": True}, outputs=outputs)))
    assert binary == {"attention_mask"}
    outputs = [{"name": "sentence_embedding", "parameters": {"binary_data": True}}, {"name": "attention_mask"}]
    _, binary = read_outputs(client.post(INFER, json=text_request(outputs=outputs)))
    assert binary == {"sentence_embedding"}


def test_binary_texts_give_what_json_texts_give(client):
    outputs = [{"name": n} for n in OUTPUTS]
    expected, _ = read_outputs(client.post(INFER, json=text_request(outputs=outputs)))
    tensor, tail = binary_input("text", TEXTS)
    got, _ = read_outputs(post_binary(client, INFER, {"inputs": [tensor], "outputs": outputs}, tail))
    for name in OUTPUTS:
        np.testing.assert_allclose(got[name], expected[name], atol=1e-6)


def _framing_cases() -> list[tuple[str, dict, bytes, int | None, str]]:
    data = length_prefixed(["hello"])
    declared = {"name": "text", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": len(data)}}
    too_big = {**declared, "parameters": {"binary_data_size": len(data) + 1}}
    return [
        ("size past the tail", {"inputs": [too_big]}, data, None, f"binary_data_size {len(data) + 1} does not fit the {len(data)} bytes sent"),
        ("tail longer than declared", {"inputs": [declared]}, data + b"xx", None, f"binary_data_size {len(data)} does not match the {len(data) + 2} bytes sent"),
        ("a tail and no binary input", text_request(), data, None, f"binary_data_size 0 does not match the {len(data)} bytes sent"),
        ("element length past its input", {"inputs": [declared]}, struct.pack("<I", 99) + data[4:], None, "truncated BYTES element"),
        ("half a length prefix", {"inputs": [{**declared, "parameters": {"binary_data_size": 2}}]}, b"\x05\x00", None, "truncated BYTES element"),
        ("two elements for shape [1]", {"inputs": [{**declared, "parameters": {"binary_data_size": 2 * len(data)}}]}, data + data, None, "has shape [1] but more than 1 elements"),
        ("not UTF-8", {"inputs": [{**declared, "parameters": {"binary_data_size": 6}}]}, struct.pack("<I", 2) + b"\xff\xfe", None, "element 0 of 'text' is not valid UTF-8"),
        ("header length past the body", {"inputs": [declared]}, data, 10**6, "does not fit a"),
    ]


@pytest.mark.parametrize(("header", "tail", "header_len", "message"), [c[1:] for c in _framing_cases()], ids=[c[0] for c in _framing_cases()])
def test_a_badly_framed_binary_input_is_a_422_saying_what_does_not_fit(client, header, tail, header_len, message):
    assert_error_names(post_binary(client, INFER, header, tail, header_len), 422, message)


def test_classifier_reads_each_binary_input_from_its_own_slice(ranker):
    """text and text_pair, each as JSON or binary: the tail holds only the binary ones, in order."""
    expected, _ = read_outputs(ranker.post(RANKER, json={"inputs": [json_input("text", QUERIES), json_input("text_pair", DOCUMENTS)]}))
    (text, text_bytes), (pair, pair_bytes) = binary_input("text", QUERIES), binary_input("text_pair", DOCUMENTS)
    for inputs, tail in [([text, pair], text_bytes + pair_bytes), ([json_input("text", QUERIES), pair], pair_bytes),
                         ([text, json_input("text_pair", DOCUMENTS)], text_bytes), ([pair, text], pair_bytes + text_bytes)]:
        got, _ = read_outputs(post_binary(ranker, RANKER, {"inputs": inputs}, tail))
        np.testing.assert_allclose(got["logits"], expected["logits"], atol=1e-5)
    assert abs(expected["logits"][0, 0] - expected["logits"][1, 0]) > 1e-3, "the two pairs score apart"


def test_classifier_reads_the_binary_flags_as_the_embedding_model_does(ranker):
    request = {"inputs": [json_input("text", QUERIES), json_input("text_pair", DOCUMENTS)]}
    _, binary = read_outputs(ranker.post(RANKER, json={**request, "parameters": {"binary_data_output": False}}))
    assert binary == set()
    _, binary = read_outputs(ranker.post(RANKER, json={**request, "parameters": {"binary_data_output": True}}))
    assert binary == {"logits", "scores"}
    outputs = [{"name": "logits", "parameters": {"binary_data": False}}, {"name": "scores"}]
    _, binary = read_outputs(ranker.post(RANKER, json={**request, "outputs": outputs, "parameters": {"binary_data_output": True}}))
    assert binary == {"scores"}
    r = ranker.post(RANKER, json={**request, "parameters": {"binary_data_output": "false"}})
    assert_error_names(r, 422, "parameters.binary_data_output")
    r = ranker.post(RANKER, json={**request, "outputs": [{"name": "logits", "parameters": {"binary_data": "false"}}]})
    assert_error_names(r, 422, "outputs.0.parameters.binary_data")


def test_classifier_over_grpc_gives_what_http_gives(ray_serve, ranker):
    """text and text_pair over KServe v2 gRPC (tritonclient.grpc): the same logits and scores."""
    import tritonclient.grpc as triton_grpc

    expected, _ = read_outputs(ranker.post(RANKER, json={"inputs": [json_input("text", QUERIES), json_input("text_pair", DOCUMENTS)]}))
    client = triton_grpc.InferenceServerClient(ray_serve.grpc_target)
    try:
        inputs = []
        for name, texts in (("text", QUERIES), ("text_pair", DOCUMENTS)):
            tensor = triton_grpc.InferInput(name, [len(texts)], "BYTES")
            tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
            inputs.append(tensor)
        result = client.infer("ranker", inputs, headers={"application": "v2params"})
        for name in ("logits", "scores"):
            np.testing.assert_allclose(result.as_numpy(name), expected[name], atol=1e-5, err_msg=name)
        assert client.get_model_metadata("ranker", headers={"application": "v2params"}).outputs[1].name == "scores"
    finally:
        client.close()
