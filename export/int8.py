"""int8 that keeps the answer: static (calibrated) quantization, tried method by method against a 0.999 floor.

Dynamic int8 (export.optimize.quantize_int8) scales activations per run and broke min cosine 0.999 on
all-MiniLM-L6-v2 whatever MatMuls it quantized. Static int8 fixes the activations' ranges from calibration
texts (multilingual, none of them among the gate's texts, so the gate is not measured on what calibrated it):

- onnxruntime's quantize_static: QDQ nodes, per-channel weights, a CalibrationDataReader over tokenized
  batches; MinMax, Percentile or Entropy ranges; sensitive MatMuls (the FFN's output projection, whose
  input carries the GELU's outliers, and the last layer) optionally left in fp32;
- OpenVINO NNCF's post-training quantization (nncf.quantize, preset mixed, model type transformer) of
  the OpenVINO model of the fp32 graph, run by OpenVINO on the CPU (measured by benchmarks/int8.py; the
  service has no OpenVINO int8 runtime, so the export does not publish it).

choose_int8 tries methods in order and keeps the first whose graph passes the quality gate with every text
>= INT8_COSINE_FLOOR. benchmarks/int8.py measures them all. The export publishes dynamic int8 only
(export.pipeline): measured on all-MiniLM-L6-v2 and a random MPNet-base shape, no static or NNCF method held
the floor where dynamic did not (docs/performance.md, "int8"), and each one tried costs the export a
quantization and a gate. Whether that variant holds the floor is its gate's figure against
bundle.manifest.AUTO_MIN_COSINE: below it, only a request for int8 by name serves it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from bundle.contract import INPUT_NAMES
from export.optimize import _quiet, external_data_of

# the fidelity users expect of the model's embeddings: every gate text's cosine vs PyTorch fp32 at least this
INT8_COSINE_FLOOR = 0.999

# Calibration texts: what an embedding service receives (questions, reviews, facts, code, logs), several
# languages and scripts, one word to a paragraph. None is a text of export.quality's gate (CORPUS, QUERIES,
# DOCUMENTS): tests/test_int8_static.py checks it.
CALIBRATION_TEXTS = (
    "How can I update the phone number on my account?",
    "The battery lasts about two days with normal use, less when the screen is bright.",
    "Our team shipped the new search feature a week ahead of schedule.",
    "cheap flights from london to lisbon in march",
    "Wie lange dauert die Bearbeitung meiner Rücksendung normalerweise?",
    "Die Bibliothek bleibt wegen Renovierungsarbeiten bis Ende Juni geschlossen.",
    "Je voudrais annuler ma réservation pour vendredi soir, est-ce possible ?",
    "La réunion a été reportée à la semaine prochaine en raison des grèves.",
    "¿Dónde puedo encontrar el manual de instrucciones en español?",
    "Las ventas del tercer trimestre superaron todas las previsiones.",
    "Il treno per Milano è in ritardo di venti minuti.",
    "O hotel fica perto da praia e o café da manhã está incluído.",
    "De vergadering begint om negen uur in de grote zaal.",
    "Dostawa była szybka, ale opakowanie było uszkodzone.",
    "Как мне восстановить доступ к своей учётной записи?",
    "Сегодня вечером ожидается сильный ветер и дождь.",
    "我的订单什么时候发货？",
    "这家酒店的服务非常好，房间也很干净。",
    "明日の会議は午後三時から始まります。",
    "배송이 너무 늦어서 실망했습니다.",
    "Bu ürünü iade etmek istiyorum, ne yapmalıyım?",
    "مرحبا، أريد تغيير كلمة المرور الخاصة بي.",
    "मुझे अपने ऑर्डर की स्थिति जाननी है।",
    "for i in range(10): print(i * i)",
    "git rebase -i HEAD~3 && git push --force-with-lease",
    "WARN 2024-05-02T11:23:45Z disk usage at 91% on /var/lib/postgresql",
    "The mitochondria is the organelle that produces most of the cell's energy.",
    "Volcanic eruptions can cool the global climate for several years.",
    "thanks",
    "no",
    "Great!",
    "refund",
    # long enough for ranges past the first hundred positions, short enough that one padded batch of every text
    # (the histogram methods' calibration) stays small
    " ".join(["The customer wrote again about the same billing problem and asked for a call back."] * 10),
)


@dataclass(frozen=True)
class Int8Method:
    """One way of quantizing with onnxruntime: dynamic (activations scaled per run), or static with its ranges'
    calibration and the MatMuls it leaves in fp32."""

    name: str
    calibrate: str | None = "MinMax"  # onnxruntime.quantization.CalibrationMethod's name; None: dynamic
    keep_fp32: tuple[str, ...] = ()  # "ffn-output", "last-layer"
    extra: dict = field(default_factory=dict)

    @property
    def histogram(self) -> bool:
        """Whether its calibrator keeps histograms (calibrated on one batch: calibration_feeds' one_batch)."""
        return self.calibrate in ("Percentile", "Entropy", "Distribution")

    def describe(self) -> str:
        if self.calibrate is None:
            return "quantize_dynamic int8 weights"
        kept = f", fp32: {' and '.join(self.keep_fp32)}" if self.keep_fp32 else ""
        return f"quantize_static int8 QDQ per-channel weights, {self.calibrate} ranges{kept}"


DYNAMIC = Int8Method("dynamic", None)
# Measured by benchmarks/int8.py (docs/performance.md, int8): dynamic (2.0x fp32 on all-MiniLM-L6-v2), then static
# with the sensitive MatMuls in fp32 (the most faithful static method measured, 0.5x fp32 there: QDQ around the
# fused graph's MatMuls costs more than int8 saves at this size) are the order worth trying (EXPORT_METHODS). Static MinMax, Percentile and Entropy fell below dynamic's min cosine on MiniLM (0.958-0.963 vs 0.962), as
# MinMax and Percentile did on the MPNet-base shape (0.993, 0.997 vs 0.9996), at more cost: measured, not tried.
STATIC_METHODS = (
    Int8Method("minmax"),
    Int8Method("percentile", "Percentile", extra={"CalibPercentile": 99.999}),
    Int8Method("entropy", "Entropy"),
    Int8Method("minmax-keep-ffn-output", keep_fp32=("ffn-output",)),
    Int8Method("minmax-keep-ffn-output-last-layer", keep_fp32=("ffn-output", "last-layer")),
)
EXPORT_METHODS = (DYNAMIC, STATIC_METHODS[-1])


def calibration_feeds(tokenizer, max_tokens: int, pad_id: int, one_batch: bool = False,
                      texts: Sequence[str] = CALIBRATION_TEXTS, size: int = 8) -> list[dict[str, np.ndarray]]:
    """The calibration texts tokenized as the gate tokenizes (truncated, padded per batch): the graph's feeds.
    one_batch: every text in one batch; onnxruntime's histogram calibrators (Percentile, Entropy) stack every
    batch's tensors into one array, and batches of different lengths make it fail."""
    from export.quality import _batches

    size = len(texts) if one_batch else size

    return [dict(zip(INPUT_NAMES, (p.input_ids, p.attention_mask, p.token_type_ids), strict=True))
            for p in _batches(tokenizer, texts, max_tokens, pad_id, size=size)]


def _excluded_nodes(graph: onnx.ModelProto, keep_fp32: Sequence[str]) -> list[str]:
    """The names of the MatMuls `keep_fp32` leaves in fp32: our encoder's FFN output projections
    (`ffn/linear2`), and every node of the last layer (the optimizer's fused Attention_<i> included)."""
    names = [n.name for n in graph.graph.node]
    layers = sorted({int(n.split("/layers.")[1].split("/")[0]) for n in names if "/layers." in n})
    fused_attention = sorted(n for n in names if n.startswith("Attention_"))
    excluded = []
    if "ffn-output" in keep_fp32:
        excluded += [n for n in names if "/ffn/linear2/" in n]
    if "last-layer" in keep_fp32 and layers:
        excluded += [n for n in names if f"/layers.{layers[-1]}/" in n]
        excluded += fused_attention[-1:]
    return excluded


def quantize_static_int8(source: Path, target: Path, feeds: Sequence[dict], method: Int8Method) -> None:
    """onnxruntime's static int8 of `source` (QDQ, int8 weights per output channel, int8 activations with
    ranges from `feeds`), MatMuls only: embeddings, LayerNorms and the fused Attention's softmax stay fp32."""
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._feeds = iter(feeds)

        def get_next(self):
            return next(self._feeds, None)

    with _quiet():
        quantize_static(
            str(source), str(target), Reader(), quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"],
            per_channel=True, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
            nodes_to_exclude=_excluded_nodes(onnx.load(str(source), load_external_data=False), method.keep_fp32),
            calibrate_method=CalibrationMethod[method.calibrate],
            use_external_data_format=external_data_of(source).exists(),
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT, **method.extra},
        )


def quantize_nncf_int8(source: Path, feeds: Sequence[dict]):
    """NNCF's post-training int8 of the fp32 graph read by OpenVINO (preset mixed: symmetric weights, asymmetric
    activations; model type transformer: its ignored patterns for attention); returns the OpenVINO model."""
    import nncf
    import openvino as ov

    model = ov.Core().read_model(str(source))
    with _quiet():
        return nncf.quantize(model, nncf.Dataset(list(feeds)), preset=nncf.QuantizationPreset.MIXED,
                             model_type=nncf.ModelType.TRANSFORMER, subset_size=sum(len(f["input_ids"]) for f in feeds))


@dataclass(frozen=True)
class Int8Choice:
    """What the int8 step found: the method kept (None where none held the floor), its gate, and every try."""

    method: Int8Method | None
    gate: object | None  # bundle.manifest.QualityGate of the kept graph
    tried: list[tuple[str, object]]  # (method name, its QualityGate, or why the quantizer refused) in order

    def best(self) -> tuple[str, object] | None:
        """The gated try with the highest min cosine (what to report when none held)."""
        gated = [t for t in self.tried if not isinstance(t[1], str)]
        return max(gated, key=lambda t: t[1].min_cosine, default=None)

    def summary(self) -> str:
        """One line: which method held the floor, or that none did and the best figure."""
        if self.method is not None:
            return (f"int8: {self.method.name} holds every text >= {INT8_COSINE_FLOOR:g} "
                    f"(min cosine {self.gate.min_cosine:.5f}, tried {len(self.tried)})")
        best = self.best()
        figure = f"best min cosine {best[1].min_cosine:.5f} ({best[0]})" if best else "no method ran"
        refused = "".join(f"; {name}: {why}" for name, why in self.tried if isinstance(why, str))
        return (f"int8: no method held every text >= {INT8_COSINE_FLOOR:g} vs PyTorch fp32 over "
                f"{len(self.tried)} tried, {figure}{refused}")


def choose_int8(source: Path, target: Path, gate: Callable[[Path], object], tokenizer, max_tokens: int,
                       pad_id: int, methods: Sequence[Int8Method] = EXPORT_METHODS) -> Int8Choice:
    """Quantize `source` by each method in turn and gate it (`gate(path)` -> QualityGate, its floor
    INT8_COSINE_FLOOR); keep the first that passes at `target`. None passing: no file is left at `target`."""
    from export.optimize import quantize_int8

    tried = []
    for method in methods:
        try:
            if method.calibrate is None:
                quantize_int8(source, target)
            else:
                feeds = calibration_feeds(tokenizer, max_tokens, pad_id, one_batch=method.histogram)
                quantize_static_int8(source, target, feeds, method)
        except Exception as exc:  # onnxruntime's quantizer refusing a graph must not fail the export
            tried.append((method.name, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"))
            continue
        result = gate(target)
        tried.append((method.name, result))
        if result.passed:
            return Int8Choice(method, result, tried)
    target.unlink(missing_ok=True)
    external_data_of(target).unlink(missing_ok=True)
    return Int8Choice(None, None, tried)
