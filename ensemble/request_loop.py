"""The request loop of the models' execute(): each request's inputs as numpy arrays by name, and an
answer for every request, also when handling it fails (that request alone gets the error).

A ValueError is bad input: its message goes to the client as is (INVALID_ARG, HTTP 400). Anything
else is ours: logged, and answered as an internal error. Only callable inside the Python backend,
which provides `triton_python_backend_utils`.
"""

from __future__ import annotations


def inputs_of(request) -> dict:
    return {t.name(): t.as_numpy() for t in request.inputs()}


def respond(model: str, requests, convert) -> list:
    """For models that return one response per request: convert(request, inputs) -> {output name:
    array}."""
    import triton_python_backend_utils as pb_utils

    responses = []
    for request in requests:
        try:
            outputs = convert(request, inputs_of(request))
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(name, value) for name, value in outputs.items()]
                )
            )
        except Exception as exc:
            responses.append(pb_utils.InferenceResponse(error=failure(model, exc)))
    return responses


def dispatch(model: str, requests, handle) -> None:
    """For models that answer through response senders: handle(request, inputs, sender) sends the
    responses or arranges for them; a failure is sent as the request's final response."""
    import triton_python_backend_utils as pb_utils

    for request in requests:
        sender = request.get_response_sender()
        try:
            handle(request, inputs_of(request), sender)
        except Exception as exc:  # never leave a request without its FINAL flag
            sender.send(
                pb_utils.InferenceResponse(error=failure(model, exc)),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )


def failure(model: str, exc: Exception):
    """The Triton error answering a request whose handling raised `exc`."""
    if isinstance(exc, ValueError):
        return triton_error(str(exc))
    import triton_python_backend_utils as pb_utils

    pb_utils.Logger.log_error(f"{model}: unexpected error: {exc!r}")
    return triton_error(f"internal error: {exc}", "INTERNAL")


def triton_error(message: str, code_name: str = "INVALID_ARG"):
    """A Triton error with a code (INVALID_ARG = HTTP 400) where the stub has it."""
    import triton_python_backend_utils as pb_utils

    code = getattr(pb_utils.TritonError, code_name, None)
    return pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
