"""The policy as an ONNX model: built once by the learner, weights patched per version,
run by simulators with onnxruntime. This module never imports torch, nor the onnx
package: the learner publishes its first model before torch is even imported.

The graph (``PolicyNet``) takes raw observations under the input name ``onnx::Gemm_0``
(float32, shape [batch, obs_dim]), normalizes them with the learner's running statistics
when asked to (its first nodes: subtract the mean, multiply by the inverse standard
deviation, clip to +-10), runs an MLP, and gives output 0, the action distribution inputs
(the logits, or means and log-stds). That is exactly what RLlib's own client feeds and
reads (RLLINK.md), and no client ever holds the statistics. Weights use torch's
``nn.Linear`` layout ([out, in]; Gemm transB=1), so the learner hands its parameters over
without transposing. The model is written with ``shmrl.onnx_graph``: a new version is one
``bytes.join`` of fixed pieces and weight bytes.
"""
from __future__ import annotations

import base64
import gzip
import math

import numpy as np

from shmrl.onnx_graph import Graph, ModelTemplate

INPUT_NAME = "onnx::Gemm_0"
OUTPUT_NAME = "action_dist_inputs"
# torch.nn activation class name -> ONNX operator.
ONNX_ACTIVATIONS = {"ReLU": "Relu", "Tanh": "Tanh", "Sigmoid": "Sigmoid", "ELU": "Elu"}
OBS_CLIP = 10.0     # normalized observations are clipped to +-10, as VecNormalize does
LOG_STD_INIT = 0.0  # a Gaussian policy starts with standard deviation 1 per action dimension


def init_mlp_weights(sizes: list[int], out_gain: float, rng: np.random.Generator) -> list[np.ndarray]:
    """(w0, b0, w1, b1, ...) for an MLP: orthogonal weights with gain sqrt(2) in the hidden
    layers and ``out_gain`` in the last, zero biases (as torch.nn.init.orthogonal_ does,
    in numpy, so that the first policy exists before torch is loaded)."""
    params = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        gain = out_gain if i == len(sizes) - 2 else math.sqrt(2)
        a = rng.standard_normal((max(n_out, n_in), min(n_out, n_in)))
        q, r = np.linalg.qr(a)
        q *= np.sign(np.diag(r))        # a uniformly distributed orthogonal matrix
        w = q if n_out >= n_in else q.T
        params += [(gain * w).astype(np.float32), np.zeros(n_out, np.float32)]
    return params


def with_log_std(mean_weights: list[np.ndarray], log_std: np.ndarray) -> list[np.ndarray]:
    """The published layout of a Gaussian policy: the mean network's last layer gets a row
    of zero weights per action dimension whose bias is its log-std, so output 0 is
    [means, log-stds] (RLlib's action_dist_inputs) from a plain MLP graph."""
    *hidden, w, b = mean_weights
    log_std = np.asarray(log_std, np.float32).reshape(-1)
    return [*hidden, np.concatenate([w, np.zeros((len(log_std), w.shape[1]), np.float32)]),
            np.concatenate([b, log_std]).astype(np.float32)]


def mlp_names(n_layers: int) -> list[str]:
    """The names of an MLP's weights in the graph: w0, b0, w1, b1, ..."""
    return [f"{wb}{i}" for i in range(n_layers) for wb in "wb"]


def mlp_graph(sizes: list[int], activation: str = "ReLU", normalize_obs: bool = False) -> Graph:
    """Observation (normalized, with ``normalize_obs``) -> MLP of ``sizes`` -> output 0."""
    if activation not in ONNX_ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {sorted(ONNX_ACTIVATIONS)}")
    g = Graph()
    x = g.input(INPUT_NAME, ["batch", sizes[0]])
    if normalize_obs:
        centred = g.node("Sub", [x, g.param("obs_mean", (sizes[0],))], "obs_centred")
        scaled = g.node("Mul", [centred, g.param("obs_inv_std", (sizes[0],))], "obs_scaled")
        x = g.node("Clip", [scaled, g.const("obs_clip_min", np.float32(-OBS_CLIP)),
                            g.const("obs_clip_max", np.float32(OBS_CLIP))], "obs_normalized")
    last = len(sizes) - 2
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        w, b = g.param(f"w{i}", (n_out, n_in)), g.param(f"b{i}", (n_out,))
        pre = g.node("Gemm", [x, w, b], OUTPUT_NAME if i == last else f"z{i}", transB=1)
        x = pre if i == last else g.node(ONNX_ACTIVATIONS[activation], [pre], f"h{i}")
    g.output(OUTPUT_NAME, ["batch", sizes[-1]])
    return g


class PolicyNet:
    """The published policy of an environment: layer sizes, whether observations are
    normalized in the graph, the graph's template and the first weights.

    Weights are a dict by graph name: ``w0, b0, ...`` (the last layer is the head, with a
    Gaussian's log-std rows, see ``with_log_std``) and, with ``normalize_obs``,
    ``obs_mean`` and ``obs_inv_std``."""

    def __init__(self, spec, hidden: int, activation: str = "ReLU", normalize_obs: bool = False,
                 log_std_init: float = LOG_STD_INIT):
        self.spec, self.hidden, self.activation, self.normalize_obs = spec, hidden, activation, normalize_obs
        self.log_std_init = log_std_init
        self.obs_dim = spec.obs_shape[0]
        self.sizes = [self.obs_dim, hidden, hidden, spec.policy_outputs]
        self.template: ModelTemplate = mlp_graph(self.sizes, activation, normalize_obs).template()

    @property
    def action_dims(self) -> int:
        """Discrete actions, or dimensions of a Gaussian's mean."""
        return self.spec.policy_outputs // 2 if self.spec.continuous else self.spec.policy_outputs

    def weights(self, mlp: list[np.ndarray], obs_mean=None, obs_var=None) -> dict[str, np.ndarray]:
        """The graph's weights from the MLP's (w0, b0, ..., in the published layout) and the
        observation statistics (mean and variance; ignored unless ``normalize_obs``)."""
        out = dict(zip(mlp_names(len(self.sizes) - 1), mlp))
        if self.normalize_obs:
            mean = np.zeros(self.obs_dim) if obs_mean is None else obs_mean
            var = np.ones(self.obs_dim) if obs_var is None else obs_var
            out["obs_mean"] = np.asarray(mean, np.float32)
            out["obs_inv_std"] = (1.0 / np.sqrt(np.asarray(var, np.float64) + 1e-8)).astype(np.float32)
        return out

    def mlp(self, weights: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [weights[name] for name in mlp_names(len(self.sizes) - 1)]

    def initial_weights(self, seed: int) -> dict[str, np.ndarray]:
        """The first policy: orthogonal weights with a small last layer, so that its first
        actions are near uniform (or near zero, with std 1); statistics of a standard normal."""
        if not self.spec.continuous:
            return self.weights(init_mlp_weights(self.sizes, 0.01, np.random.default_rng(seed)))
        d = self.action_dims
        means = init_mlp_weights([*self.sizes[:-1], d], 0.01, np.random.default_rng(seed))
        return self.weights(with_log_std(means, np.full(d, self.log_std_init, np.float32)))

    def check(self, weights: dict[str, np.ndarray]) -> str | None:
        """Why ``weights`` (a checkpoint's) do not fit this network, or None."""
        for name, shape in self.template.shapes.items():
            if name not in weights:
                return f"it has no {name!r} (saved without observation normalization?)"
            if weights[name].shape != shape:
                return f"its {name!r} has shape {weights[name].shape}, this network's {shape}"
        extra = set(weights) - set(self.template.shapes)
        return f"it has {sorted(extra)}, this network does not (saved with observation normalization?)" \
            if extra else None


class OnnxPublisher:
    """A plain MLP policy (no normalization) from its weights as a list w0, b0, ...: the
    published form tests and benchmarks build by hand."""

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
    Stored, not compressed: float weights barely compress (about 10% at level 1), and
    level 0 encodes 14x and decodes 2x faster here (0.04 against 0.60 ms, 0.09 against
    0.21 ms for the 64x64 policy), on every publish and in every simulator."""
    return base64.b64encode(gzip.compress(model_bytes, compresslevel=0)).decode("ascii")


def decode_onnx_file(onnx_file: str | bytes) -> bytes:
    if isinstance(onnx_file, str):
        onnx_file = onnx_file.encode("ascii")
    return gzip.decompress(base64.b64decode(onnx_file, validate=True))


class OnnxPolicy:
    """onnxruntime session for one model; ``logits(obs_batch)`` -> float32 [batch, n].

    Inference goes through an IOBinding per batch size: the observation is copied into a
    bound input buffer and the output lands in a bound array, which skips the argument
    checks and allocations of ``InferenceSession.run`` (measured here: 8 us per call at
    batch 1 against 17 us).
    """

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
        output = self.session.get_outputs()[0]
        self.output_name, self.n_outputs = output.name, output.shape[-1]
        self._bound: dict[int, tuple] = {}  # batch size -> (binding, input buffer, output buffer)

    def logits(self, obs: np.ndarray) -> np.ndarray:
        """Output 0 for a batch of observations (a new array: the caller may keep it)."""
        bound = self._bound.get(len(obs))
        if bound is None:
            bound = self._bind(len(obs), obs.shape[1:])
        binding, x, y = bound
        x[...] = obs
        self.session.run_with_iobinding(binding)
        return y.copy()

    def _bind(self, batch: int, obs_shape: tuple) -> tuple:
        if not isinstance(self.n_outputs, int):  # a model from elsewhere, output size unnamed
            self.n_outputs = self.session.run([self.output_name], {self.input_name: np.zeros(
                (1, *obs_shape), np.float32)})[0].shape[-1]
        x = np.zeros((batch, *obs_shape), np.float32)
        y = np.zeros((batch, self.n_outputs), np.float32)
        binding = self.session.io_binding()
        binding.bind_cpu_input(self.input_name, x)
        binding.bind_output(self.output_name, "cpu", 0, np.float32, list(y.shape), y.ctypes.data)
        self._bound[batch] = (binding, x, y)
        return self._bound[batch]
