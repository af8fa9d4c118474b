"""AWQ calibration: a float checkpoint's layers scaled by their inputs' magnitudes on calibration
text run through the engine (backend/tools/calibration.py), then rounded to 4 bits and written as an
AWQ checkpoint (`int4_awq`; backend/quantization/awq.py, awq_checkpoint.py).

    python -m backend.tools.awq_calibration --model default --calibration TEXT_FILE --out DIR \
        [--group-size 128] [--rounding nearest|clip|gptq]

One pass of the float model gives every projection's H and mean|x|: folding the scales leaves
the float model as it was, so no layer's inputs depend on another layer's scales.
"""

from __future__ import annotations

from backend.quantization.awq_checkpoint import ROUNDINGS, write_awq_checkpoint
from backend.tools.calibration import calibrate_on_text, calibration_parser, read_text


def quantize_model(
    model: str,
    calibration_text: str,
    out_dir: str,
    group_size: int,
    num: int,
    length: int,
    rounding: str = "clip",
) -> str:
    """Calibrate and write the AWQ checkpoint of `model` (a name or directory); returns out_dir."""
    float_dir, inputs, targets = calibrate_on_text(model, calibration_text, num, length)
    scaled = write_awq_checkpoint(float_dir, out_dir, inputs, targets, group_size, rounding)
    for name, choice in scaled.choices.items():
        gain = choice.error / choice.rtn_error if choice.rtn_error else 1.0
        print(f"{name}: alpha {choice.alpha:.2f}, output error x{gain:.3f} of round to nearest")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    p = calibration_parser(__doc__, "AWQ")
    p.add_argument("--group-size", type=int, default=128, help="input channels per group")
    p.add_argument(
        "--rounding",
        choices=ROUNDINGS,
        default="clip",
        help="of the scaled weights: to nearest, ranges shrunk where it pays, or GPTQ's",
    )
    args = p.parse_args(argv)
    out = quantize_model(
        args.model,
        read_text(args.calibration),
        args.out,
        args.group_size,
        args.num_windows,
        args.window,
        args.rounding,
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
