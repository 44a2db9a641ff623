"""pagoda-quant: FP8 and INT4 quantization for pagoda.

Importing this package is cheap (no torch): the plugin registers quantizers and lazy
``"module:function"`` kernel strings; torch and triton load when a model uses them.
"""

__version__ = "0.1.0"
