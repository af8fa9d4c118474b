"""GPTQ calibration: a float checkpoint's layers quantized with GPTQ (backend/quantization/gptq.py)
against the input products of calibration text run through the engine, written as a GPTQ
checkpoint (4-bit, `int4_gptq`) or an FP8 one (e4m3, `fp8`).

    python -m backend.tools.gptq_calibration --model default --calibration TEXT_FILE --out DIR \
        [--weights int4|fp8] [--group-size 128] [--exclude layers.0.,layers.29.]

reads the float checkpoint, runs the calibration text through the engine with a hook on every
projection's input (backend/tools/calibration.py: a fused q|k|v or gate|up layer has one input, so
one H for its parts), then writes every decoder projection as GPTQ tensors (asymmetric, groups
of `--group-size` input channels in their plain order, g_idx = k // g, though the columns are
rounded heaviest first) or as e4m3 with a scale per output channel, and copies the rest. The
engine loads the result like any GPTQ or FP8 checkpoint. Each layer's H is taken from the float
model (not from the layers already quantized before it, as GPTQ's reference code does), which
keeps this to one pass.
"""

from __future__ import annotations

from backend.quantization.gptq import write_gptq_checkpoint
from backend.tools.calibration import calibrate as calibrate_inputs
from backend.tools.calibration import calibrate_on_text, calibration_parser, read_text


def quantize_model(
    model: str,
    calibration_text: str,
    out_dir: str,
    group_size: int,
    num: int,
    length: int,
    weights: str = "int4",
    exclude: tuple[str, ...] = (),
) -> str:
    """Calibrate and write the GPTQ checkpoint of `model` (a name or directory); returns out_dir."""
    float_dir, inputs, targets = calibrate_on_text(model, calibration_text, num, length)
    write_gptq_checkpoint(
        float_dir, out_dir, _hessians(inputs), targets, group_size, weights, exclude
    )
    return out_dir


def calibrate(float_dir: str, prompts: list[list[int]], max_seq_len: int) -> tuple[dict, dict]:
    """(H of every layer's input over `prompts`, the Hugging Face names' targets) of the float
    model in `float_dir`, run on the CPU in float32: what `write_gptq_checkpoint` takes."""
    inputs, targets = calibrate_inputs(float_dir, prompts, max_seq_len)
    return _hessians(inputs), targets


def _hessians(inputs: dict) -> dict:
    """Each layer's H out of its `LayerInputs`: all GPTQ takes."""
    return {name: layer.hessian for name, layer in inputs.items()}


def main(argv: list[str] | None = None) -> None:
    p = calibration_parser(__doc__, "GPTQ")
    p.add_argument("--weights", choices=("int4", "fp8"), default="int4", help="the format")
    p.add_argument("--group-size", type=int, default=128, help="int4 groups")
    p.add_argument(
        "--exclude",
        default="",
        help="comma-separated fragments of module names kept float (e.g. 'layers.0.,layers.1.')",
    )
    args = p.parse_args(argv)
    exclude = tuple(fragment for fragment in args.exclude.split(",") if fragment)
    out = quantize_model(
        args.model,
        read_text(args.calibration),
        args.out,
        args.group_size,
        args.num_windows,
        args.window,
        args.weights,
        exclude,
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
