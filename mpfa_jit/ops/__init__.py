"""One module per operation: each turns an operation's arguments into a KernelSpec and says which
specializations a server of a given shape needs (warmup reads ``server_specs`` of every op here)."""
from . import append_kv

# Operations a server needs kernels for; the prefill and decode issues add theirs here.
OPS = (append_kv,)
