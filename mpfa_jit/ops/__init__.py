"""One module per operation: each turns an operation's arguments into a KernelSpec and says which
specializations a server of a given shape needs (warmup reads ``server_specs`` of every op here)."""
from . import append_kv, decode, prefill

# Operations a server needs kernels for.
OPS = (append_kv, decode, prefill)
