"""The policy as an ONNX model: built once by the learner, weights patched per version,
run by simulators with onnxruntime. This module never imports torch.

The graph is an MLP (Gemm + activation layers) whose single input is named
``onnx::Gemm_0`` (float32, shape [batch, obs_dim]) and whose output 0 is the action
distribution inputs (the logits), which is exactly what RLlib's own client feeds and
reads (RLLINK.md). Weights use torch's ``nn.Linear`` layout ([out, in]; Gemm transB=1),
so the learner hands over its parameters without transposing.
"""
from __future__ import annotations

import base64
import gzip

import numpy as np

INPUT_NAME = "onnx::Gemm_0"
OUTPUT_NAME = "action_dist_inputs"
# torch.nn activation class name -> ONNX operator.
ONNX_ACTIVATIONS = {"ReLU": "Relu", "Tanh": "Tanh", "Sigmoid": "Sigmoid", "ELU": "Elu"}


def build_mlp(sizes: list[int], activation: str = "ReLU"):
    """An ONNX ModelProto for an MLP with layer sizes ``sizes`` (input first), zero weights."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, initializers = [], []
    x = INPUT_NAME
    n_layers = len(sizes) - 1
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        initializers.append(numpy_helper.from_array(np.zeros((n_out, n_in), np.float32), f"w{i}"))
        initializers.append(numpy_helper.from_array(np.zeros(n_out, np.float32), f"b{i}"))
        last = i == n_layers - 1
        pre = OUTPUT_NAME if last else f"z{i}"
        nodes.append(helper.make_node("Gemm", [x, f"w{i}", f"b{i}"], [pre], transB=1))
        if not last:
            x = f"h{i}"
            nodes.append(helper.make_node(ONNX_ACTIVATIONS[activation], [pre], [x]))
    graph = helper.make_graph(
        nodes, "shmrl_policy",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["batch", sizes[0]])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", sizes[-1]])],
        initializers)
    # Opset 17 / IR 8: old enough for every onnxruntime RLlib 2.48 ships with.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="shmrl")
    model.ir_version = 8
    return model


class OnnxPublisher:
    """Holds the exported graph; ``publish`` rewrites only the initializers' bytes."""

    def __init__(self, sizes: list[int], activation: str = "ReLU"):
        import onnx

        self.model = build_mlp(sizes, activation)
        onnx.checker.check_model(self.model)
        self._initializers = list(self.model.graph.initializer)

    def publish(self, params: list[np.ndarray]) -> bytes:
        """Serialized model with ``params`` (w0, b0, w1, b1, ...) patched in."""
        if len(params) != len(self._initializers):
            raise ValueError(f"expected {len(self._initializers)} arrays, got {len(params)}")
        for init, p in zip(self._initializers, params):
            p = np.ascontiguousarray(p, dtype="<f4")
            if tuple(p.shape) != tuple(init.dims):
                raise ValueError(f"{init.name}: shape {p.shape} != {tuple(init.dims)}")
            init.raw_data = p.tobytes()
        return self.model.SerializeToString()


def encode_onnx_file(model_bytes: bytes) -> str:
    """SET_STATE's ``onnx_file``: base64 of the gzip-compressed model, as RLlib sends it."""
    return base64.b64encode(gzip.compress(model_bytes, compresslevel=1)).decode("ascii")


def decode_onnx_file(onnx_file: str | bytes) -> bytes:
    if isinstance(onnx_file, str):
        onnx_file = onnx_file.encode("ascii")
    return gzip.decompress(base64.b64decode(onnx_file, validate=True))


class OnnxPolicy:
    """onnxruntime session for one model; ``logits(obs_batch)`` -> float32 [batch, n]."""

    def __init__(self, model_bytes: bytes):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        # Simulators are many small processes on few cores: one thread each, and the
        # graph is too small for optimization passes to pay back their cost.
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self.session = ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name
        self.output_names = [self.session.get_outputs()[0].name]

    def logits(self, obs: np.ndarray) -> np.ndarray:
        return self.session.run(self.output_names, {self.input_name: obs})[0]
