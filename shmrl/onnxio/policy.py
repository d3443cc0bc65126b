"""The policy as an ONNX model: what clients run. The network itself, and the graph the
learner publishes for it, are described in ``shmrl.model.net`` (which this never imports: the
names both use are in ``shmrl.onnxio.graph``); this module has what every
client needs (decoding SET_STATE's ``onnx_file``, running the model with onnxruntime) and
a plain MLP graph that tests and benchmarks build by hand. It never imports torch, nor
the onnx package.

The published graph takes raw observations, one input per observation leaf
(``onnx::Gemm_0``, float32 [batch, obs_dim], for a flat Box: what RLlib's own client
feeds), and gives output 0, the action distribution inputs (logits, or means and
log-stds): what RLlib's client reads (docs/RLLINK.md). A recurrent policy (``--memory``) also
takes its state before the step as inputs ``state_in.<i>`` and gives the state after it as
outputs ``state_out.<i>``, float32 [batch, memory_size] each (``shmrl.model.net``).
"""
from __future__ import annotations

import base64
import gzip

import numpy as np

from shmrl.onnxio.graph import ACTION_DIST_KEY, ONNX_ACTIVATIONS, OUTPUT_NAME, Graph, orthogonal
from shmrl.core.spaces import FLAT_INPUT as INPUT_NAME


def init_mlp_weights(sizes: list[int], out_gain: float, rng: np.random.Generator) -> list[np.ndarray]:
    """(w0, b0, w1, b1, ...) for an MLP: orthogonal weights with gain sqrt(2) in the hidden
    layers and ``out_gain`` in the last, zero biases (torch.nn.init.orthogonal_, in numpy)."""
    params = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        gain = out_gain if i == len(sizes) - 2 else np.sqrt(2)
        params += [orthogonal((n_out, n_in), gain, rng), np.zeros(n_out, np.float32)]
    return params


def with_log_std(mean_weights: list[np.ndarray], log_std: np.ndarray) -> list[np.ndarray]:
    """A Gaussian policy's MLP in the published layout: the last layer gets a row of zero
    weights per action dimension whose bias is its log-std, so output 0 is [means, log-stds]."""
    *hidden, w, b = mean_weights
    log_std = np.asarray(log_std, np.float32).reshape(-1)
    return [*hidden, np.concatenate([w, np.zeros((len(log_std), w.shape[1]), np.float32)]),
            np.concatenate([b, log_std]).astype(np.float32)]


def mlp_names(n_layers: int) -> list[str]:
    """The names of an MLP's weights in ``mlp_graph``: w0, b0, w1, b1, ..."""
    return [f"{wb}{i}" for i in range(n_layers) for wb in "wb"]


def mlp_graph(sizes: list[int], activation: str = "ReLU") -> Graph:
    """Observation -> MLP of ``sizes`` -> output 0: the bytes onnx.helper writes for it."""
    if activation not in ONNX_ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {sorted(ONNX_ACTIVATIONS)}")
    g = Graph()
    x = g.input(INPUT_NAME, ["batch", sizes[0]])
    last = len(sizes) - 2
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        w, b = g.param(f"w{i}", (n_out, n_in)), g.param(f"b{i}", (n_out,))
        pre = g.node("Gemm", [x, w, b], OUTPUT_NAME if i == last else f"z{i}", transB=1)
        x = pre if i == last else g.node(ONNX_ACTIVATIONS[activation], [pre], f"h{i}")
    g.output(OUTPUT_NAME, ["batch", sizes[-1]])
    return g


class OnnxPublisher:
    """A plain MLP policy from its weights as a list w0, b0, ...: the published form tests
    and benchmarks build by hand."""

    def __init__(self, sizes: list[int], activation: str = "ReLU"):
        self.sizes = list(sizes)
        self.template = mlp_graph(self.sizes, activation).template()

    def publish(self, params: list[np.ndarray]) -> bytes:
        names = mlp_names(len(self.sizes) - 1)
        if len(params) != len(names):
            raise ValueError(f"expected {len(names)} arrays, got {len(params)}")
        return self.template.publish(dict(zip(names, params)))


def encode_onnx_file(model_bytes: bytes) -> str:
    """SET_STATE's ``onnx_file``: base64 of the model in gzip format, as RLlib sends it.
    Stored, not compressed: float weights barely compress, and level 0 is the fastest to
    encode and decode, on every publish and in every simulator."""
    return base64.b64encode(gzip.compress(model_bytes, compresslevel=0)).decode("ascii")


def decode_onnx_file(onnx_file: str | bytes) -> bytes:
    if isinstance(onnx_file, str):
        onnx_file = onnx_file.encode("ascii")
    return gzip.decompress(base64.b64decode(onnx_file, validate=True))


class OnnxPolicy:
    """onnxruntime session for one model; ``logits(obs)`` -> float32 [batch, n].

    ``obs`` is an array (a model with one input) or a dict of arrays by observation leaf
    (``shmrl.core.spaces``), each fed to the input of its name (``obs.<leaf>``, or the leaf's
    own name, ``action_mask``). Inference goes through an IOBinding per batch size: the
    observation is copied into bound input buffers and the output lands in a bound array,
    which skips the argument checks and allocations of ``InferenceSession.run`` (at batch 1
    those are most of a call's time).

    A recurrent model (inputs ``state_in.<i>``) runs through ``step(obs, state)`` instead,
    with its state flat: [batch, state_size], the ``state_in.<i>`` side by side.
    """

    _DTYPES = {"tensor(float)": np.float32, "tensor(uint8)": np.uint8, "tensor(int64)": np.int64}

    def __init__(self, model_bytes: bytes):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        # Simulators are many small processes on few cores: one thread each, and the
        # graph is too small for optimization passes to pay back their cost.
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self.session = ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.input_name = self.session.get_inputs()[0].name
        output = self.session.get_outputs()[0]
        self.output_name, self.n_outputs = output.name, output.shape[-1]
        self.state_inputs = sorted((name for name in self.inputs if name.startswith("state_in.")),
                                   key=lambda name: int(name.split(".", 1)[1]))
        self.state_sizes = [int(self.inputs[name].shape[-1]) for name in self.state_inputs]
        self.state_size = sum(self.state_sizes)   # 0: no memory
        # How output 0 is sampled: "squashed_gaussian" (SAC) where the model says so, else
        # None (categorical logits and Gaussian means and log-stds, as RLlib lays them out).
        self.action_dist = self.session.get_modelmeta().custom_metadata_map.get(ACTION_DIST_KEY)
        self._bound: dict[int, tuple] = {}  # batch size -> (binding, [(key, input buffer)], output buffer)

    def input_for(self, leaf: str) -> str | None:
        """The input a leaf of a dict observation is fed to (None: the model takes none)."""
        for name in (f"obs.{leaf}", leaf):
            if name in self.inputs:
                return name
        return None

    def logits(self, obs) -> np.ndarray:
        """Output 0 for a batch of observations (a new array: the caller may keep it)."""
        return self._run(obs, None)[0].copy()

    def initial_state(self, batch: int) -> np.ndarray:
        """The state an episode starts from: zeros, [batch, state_size]."""
        return np.zeros((batch, self.state_size), np.float32)

    def step(self, obs, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(output 0, state after) of a recurrent model for observations and the state before
        (new arrays: the caller may keep them)."""
        y, outs = self._run(obs, state)
        return y.copy(), np.concatenate(outs, axis=1)

    def _run(self, obs, state):
        rows = len(next(iter(obs.values()))) if isinstance(obs, dict) else len(obs)
        bound = self._bound.get(rows)
        if bound is None:
            bound = self._bind(rows, obs)
        binding, buffers, y, states_in, states_out = bound
        if isinstance(obs, dict):
            for key, x in buffers:
                x[...] = obs[key]
        else:
            buffers[0][1][...] = obs
        if states_in:
            if state is None:
                raise ValueError("a recurrent policy steps with its state: use step(obs, state)")
            start = 0
            for x in states_in:
                x[...] = state[:, start:start + x.shape[1]]
                start += x.shape[1]
        self.session.run_with_iobinding(binding)
        return y, states_out

    def _bind(self, batch: int, obs) -> tuple:
        if isinstance(obs, dict):
            feeds = [(key, name) for key in obs if (name := self.input_for(key)) is not None]
        else:
            feeds = [(None, self.input_name)]
        buffers, example = [], {}
        states_in = [np.zeros((batch, n), np.float32) for n in self.state_sizes]
        for name, x in zip(self.state_inputs, states_in):
            example[name] = x[:1]
        for key, name in feeds:
            value = obs[key] if key is not None else obs
            dtype = self._DTYPES.get(self.inputs[name].type, np.float32)
            buffers.append((key, name, np.zeros((batch, *np.shape(value)[1:]), dtype)))
            example[name] = buffers[-1][2][:1]
        if not isinstance(self.n_outputs, int):  # a model from elsewhere, output size unnamed
            self.n_outputs = self.session.run([self.output_name], example)[0].shape[-1]
        y = np.zeros((batch, self.n_outputs), np.float32)
        binding = self.session.io_binding()
        for _, name, x in buffers:
            binding.bind_cpu_input(name, x)
        binding.bind_output(self.output_name, "cpu", 0, np.float32, list(y.shape), y.ctypes.data)
        states_out = [np.zeros((batch, n), np.float32) for n in self.state_sizes]
        for name, x in zip(self.state_inputs, states_in):
            binding.bind_cpu_input(name, x)
        for name, x in zip(self.state_inputs, states_out):
            out = name.replace("state_in.", "state_out.")
            binding.bind_output(out, "cpu", 0, np.float32, list(x.shape), x.ctypes.data)
        self._bound[batch] = (binding, [(key, x) for key, _, x in buffers], y, states_in, states_out)
        return self._bound[batch]
