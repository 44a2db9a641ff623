"""pagoda: a small LLM inference and serving engine.

    from pagoda import LLM, SamplingParams
    llm = LLM(model="path/to/model", device="cpu", dtype="float32")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

from pagoda.hookspecs import hookimpl
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.structured_outputs import StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name):
    # LLM, EngineConfig and LLMEngine import torch: load them on first use so that plugin
    # discovery (which imports pagoda.hookimpl) stays light.
    if name == "LLM":
        from pagoda.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagoda.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from pagoda.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'pagoda' has no attribute {name!r}")


__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "hookimpl", "__version__"]
