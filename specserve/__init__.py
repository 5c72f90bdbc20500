"""specserve: an LLM inference server whose headline is speculative decoding.

`Engine` is the offline API; `python -m specserve.launch_server` (or `specserve serve`)
starts the OpenAI-compatible server.
"""
from specserve.core.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "Engine":  # lazy: importing the package must not import torch
        from specserve.offline import Engine

        return Engine
    raise AttributeError(name)
