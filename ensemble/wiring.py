"""Static checks of an ensemble's wiring, run before a repository is written.

Triton finds most of these only at load time, one at a time, with terse messages; the decoupled
rule (a step after a decoupled model may read only tensors that come from that model) bites
silently in the generate endpoints otherwise.
"""

from __future__ import annotations

from ensemble.tensors import ModelIO, Tensor


class WiringError(ValueError):
    pass


def check_wiring(
    ensemble: ModelIO,
    models: dict[str, ModelIO],
    decoupled: frozenset[str] = frozenset({"tensorrt_llm"}),
) -> None:
    """Raise WiringError listing every problem found, or return None when the wiring is sound."""
    problems: list[str] = []
    # tensor name -> (declaration, origin label); ensemble inputs come from the request ("")
    available: dict[str, tuple[Tensor, str]] = {t.name: (t, "") for t in ensemble.inputs}
    produced_by: dict[str, str] = {}
    for step in ensemble.steps:
        model = models.get(step.model)
        if model is None:
            problems.append(f"step {step.model!r}: no such model")
            continue
        model_inputs = {t.name: t for t in model.inputs}
        model_outputs = {t.name: t for t in model.outputs}
        labels: set[str] = set()
        for name, tensor in step.inputs.items():
            declared = model_inputs.get(name)
            if declared is None:
                problems.append(f"step {step.model!r}: {name!r} is not an input of the model")
                continue
            source = available.get(tensor)
            if source is None:
                problems.append(
                    f"step {step.model!r}: input {name!r} reads {tensor!r}, which is "
                    "neither an ensemble input nor an output of an earlier step"
                )
                continue
            problems += _compare(
                f"step {step.model!r} input {name!r} <- {tensor!r}", source[0], declared
            )
            labels.add(source[1])
        for declared in model.inputs:
            if not declared.optional and declared.name not in step.inputs:
                problems.append(f"step {step.model!r}: required input {declared.name!r} is not fed")
        if len(labels) > 1:
            problems.append(
                f"step {step.model!r} mixes tensors from the request and from a "
                "decoupled step; after a decoupled step read only its outputs"
            )
        label = step.model if step.model in decoupled else (labels.pop() if labels else "")
        for name, tensor in step.outputs.items():
            declared = model_outputs.get(name)
            if declared is None:
                problems.append(f"step {step.model!r}: {name!r} is not an output of the model")
                continue
            if tensor in available:
                problems.append(
                    f"step {step.model!r}: {tensor!r} is already produced by "
                    f"{produced_by.get(tensor, 'the ensemble inputs')!r}"
                )
                continue
            available[tensor] = (declared, label)
            produced_by[tensor] = step.model
    for out in ensemble.outputs:
        source = available.get(out.name)
        if source is None or out.name not in produced_by:
            problems.append(f"ensemble output {out.name!r} is not produced by any step")
            continue
        problems += _compare(
            f"ensemble output {out.name!r} <- {produced_by[out.name]!r}", source[0], out
        )
    if problems:
        raise WiringError("ensemble wiring is broken:\n  " + "\n  ".join(problems))


def _compare(where: str, source: Tensor, target: Tensor) -> list[str]:
    problems = []
    if source.dtype != target.dtype:
        problems.append(f"{where}: type {source.dtype} does not match {target.dtype}")
    if not _dims_compatible(source.dims, target.dims):
        problems.append(f"{where}: shape {list(source.dims)} does not fit {list(target.dims)}")
    return problems


def _dims_compatible(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    if len(a) != len(b):
        return False
    return all(x == y or x == -1 or y == -1 for x, y in zip(a, b))
