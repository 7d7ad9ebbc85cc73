"""Seeing what fusednorm did.

table.py       str(report): aligned tables of fused blocks, their arguments, chains not fused, kernels
dump.py        numbered dumps of every compiled graph (FUSEDNORM_DUMP=<dir>), the report, kernels
graph_text.py  a graph as annotated Python (dtypes, shapes, source lines)
mlir.py        the rewritten graph in torch-mlir's torch dialect
trace.py       the same artifacts in PyTorch's structured trace (TORCH_TRACE=<dir>, read with tlparse)
kernels.py     record_kernel(): where the code generator reports each kernel it builds
target.py      what `python -m fusednorm explain TARGET` loads
cache_cli.py   `python -m fusednorm cache list|clear|path`
"""
