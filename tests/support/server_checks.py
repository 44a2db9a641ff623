"""Checks the server tests share."""


def check_blocks(engine) -> None:
    """The KV block manager's invariants, where the engine runs in the server's process (with the engine
    in its own process, the server's default, the replica's blocks are seen through its stats only)."""
    if hasattr(engine, "block_manager"):
        engine.block_manager.check_invariants()
