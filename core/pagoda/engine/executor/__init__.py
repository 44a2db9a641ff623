"""How a step reaches the device when a model spans several ranks: the tensor-parallel executor
(``tensor_parallel``), the control plane (``control``), the step plan's int64 form (``step_codec``), the worker loop
(``worker_main``), the worker processes (``local_workers``), one rank's runner (``rank_runner``) and
failure reports (``failures``). Process groups and the parallel state stay in ``pagoda.distributed``,
below the layers."""
