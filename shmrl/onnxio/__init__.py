"""ONNX graph bytes and the client's ONNX policy (numpy and onnxruntime; never torch)."""
