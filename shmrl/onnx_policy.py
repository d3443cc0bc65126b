"""Compatibility path (docs/EXTERNAL.md): ``shmrl.onnx_policy.OnnxPolicy`` and
``decode_onnx_file``, which live in ``shmrl.onnxio.policy``."""
from shmrl.onnxio.policy import OnnxPolicy, decode_onnx_file

__all__ = ["OnnxPolicy", "decode_onnx_file"]
