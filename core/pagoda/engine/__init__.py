"""The engine: LLMEngine (request lifecycle), ModelRunner (device state), step inputs, graphs."""
