"""Public ops: each module builds its kernel launches and runs them (CUDA) or the PyTorch path
(CPU). The ops themselves are exported from the package top level."""
