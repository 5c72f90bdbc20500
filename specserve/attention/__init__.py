"""Layer 2: attention backends behind one contract (base.py): the torch reference
(torch_ref.py, the oracle) and the Triton backend (triton_backend.py and its kernels)."""
