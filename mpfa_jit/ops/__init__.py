"""One module per operation: each turns an operation's arguments into a KernelSpec and says which
specializations a server of a given shape needs (warmup reads ``server_specs`` of every op here)."""
from . import append_kv, decode

# Operations a server needs kernels for; the prefill issue adds its own here.
OPS = (append_kv, decode)
