"""The SGLang plugin: the only package of sgl-vtoken that imports sglang."""


def register() -> None:
    """Entry point of the `sglang.srt.plugins` group; SGLang calls it in every process."""
    from .plugin import register as _register

    _register()
