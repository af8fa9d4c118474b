"""The engine as a process of its own: the client handle Triton's models and the OpenAI front end
hold (`client`), the process that serves them (`service`) and its way out to them (`outbox`)."""
