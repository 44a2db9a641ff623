"""A test plugin whose import fails, as one with a missing device library would."""

import not_an_installed_device_library  # noqa: F401
