"""python -m bundle [--brief] DIR: verify a bundle (schema, contract, hashes) and print its parity
table (--brief: one line, what `make run` prints before it starts the service).

Torch-free, like everything in this package; exit code 1 with a one-line reason if unfit.
"""

from __future__ import annotations

import sys

from bundle.manifest import BundleError, load_bundle, parity_lines, quality_line


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    brief = "--brief" in args
    args = [a for a in args if a != "--brief"]
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m bundle [--brief] BUNDLE_DIR", file=sys.stderr)
        return 2
    try:
        bundle = load_bundle(args[0])
    except BundleError as exc:
        print(f"bundle refused: {exc}", file=sys.stderr)
        return 1
    m = bundle.manifest
    shown = args[0]  # as given: the link a user names, not the version directory it points to now
    if brief:
        worst = max(o.max_abs_diff for o in m.parity.outputs)
        print(f"bundle {shown}: {m.model.name}, {len(m.files)} files verified; parity "
              f"{'passed' if m.parity.passed else 'FAILED'} on {len(m.parity.probe_shapes)} probes "
              f"(max abs diff {worst:.1e}); encodings graphs {', '.join(m.variants)}{', packed' if m.packed else ''}")
        return 0
    print(
        f"bundle {shown}: model {m.model.name}, {m.model.num_layers} layers, {m.model.num_heads} heads, "
        f"hidden {m.model.hidden_size}, max {m.model.max_tokens} tokens, opset {m.graph.opset}, "
        f"{len(m.files)} files verified"
    )
    if m.model.task == "classification":
        print(f"  classifier: logits for labels {m.model.labels} ({m.model.problem_type})")
    print("  full graph (every output, attention weights included):")
    for line in parity_lines(m.parity):
        print("    " + line)
    for precision, variant in m.variants.items():
        fused = ", ".join(f"{n} {op}" for op, n in variant.fusions.items()) or "nothing fused"
        print(f"  {precision} encodings graph {variant.file} ({fused}; for {', '.join(variant.providers)}):")
        if variant.parity is not None:
            for line in parity_lines(variant.parity):
                print("    " + line)
        if variant.quality is not None:
            print("    " + quality_line(precision, variant.quality))
    if m.packed is not None:
        print(f"  packed graph {m.packed.file} (several texts in one row, no padding; onnxruntime fp32 or OpenVINO):")
        for line in parity_lines(m.packed.parity):
            print("    " + line)
        if m.packed.bf16 is not None:
            print("    " + quality_line("bf16", m.packed.bf16))
    return 0


if __name__ == "__main__":
    sys.exit(main())
