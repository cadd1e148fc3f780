from pagellm.attention.selector import select_backend

__all__ = ["select_backend"]
