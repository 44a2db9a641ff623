"""pagoda-cuda: the CUDA platform and Triton kernels for pagoda.

Importing this package is cheap (no torch, no triton): the plugin module registers lazy
``"module:function"`` strings and objects whose methods import what they need.
"""

__version__ = "0.1.0"
