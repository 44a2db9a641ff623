"""The offline and engine handle of an adapter, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``LoRARequest("sql", 1, "/adapters/sql")``: a PEFT adapter directory under a name and a
    positive integer id. The id identifies the adapter everywhere (slot pool, CPU cache, prefix
    cache hashes): reuse an id only for the same adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be a positive integer, "
                             f"got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("LoRARequest: lora_name must not be empty")
