"""A test plugin that registers a second platform called "cpu"."""

from pagoda import hookimpl
from pagoda.interfaces import Platform


class AnotherCpu(Platform):
    name = "cpu"
    device_type = "cpu"


@hookimpl
def register_platforms(register):
    register(AnotherCpu())
