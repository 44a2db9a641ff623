"""A third-party pagoda plugin used by the plugin-contract tests: one object per hook."""

from pagoda import hookimpl
from pagoda.interfaces import AttentionBackend, KVAllocator, Platform, Quantizer


class DummyPlatform(Platform):
    name = "dummy"
    device_type = "dummy"
    priority = 50

    def unavailable_reason(self):
        return "the dummy accelerator library 'dummylib' is not installed"


class DummyBackend(AttentionBackend):
    name = "dummy_attention"
    platforms = ("dummy",)


class DummyAllocator(KVAllocator):
    name = "dummy_allocator"
    platforms = ("dummy",)


class DummyQuantizer(Quantizer):
    name = "dummy_quant"


def scaled_rms_norm(x, weight, eps):
    raise RuntimeError("only for the dummy platform")


@hookimpl
def register_platforms(register):
    register(DummyPlatform())


@hookimpl
def register_attention_backends(register):
    register(DummyBackend())


@hookimpl
def register_models(register):
    register("DummyForCausalLM", "pagoda_dummy_plugin:DummyModel")


@hookimpl
def register_quantizers(register):
    register(DummyQuantizer())


@hookimpl
def register_allocators(register):
    register(DummyAllocator())


@hookimpl
def register_kernels(register):
    register("rms_norm", "dummy", scaled_rms_norm, priority=5)
