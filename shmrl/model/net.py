"""The policy and value networks, described once and rendered twice: as the ONNX graph
that clients run (``PolicyNet.graph``) and as torch functions that the learner trains
(``forward_torch``). Each layer type below holds both renderings side by side, so the
two cannot drift apart; tests check they agree.

    observation leaves --encoder per leaf--> concatenated --trunk (MLP)--> [core] --> head

An encoder per observation leaf (``shmrl.core.spaces``): a float vector is flattened and, with
``normalize_obs``, normalized by the learner's running statistics (the graph's first
nodes); bytes are cast and scaled to [0, 1]; an image goes through a CNN (the Nature CNN
for 36x36 and larger, a small one for small grids), channels-first inside; a Discrete is
one-hot. The trunk is ``layers`` dense layers of ``hidden`` units. The actor's head gives
``action_dist_inputs``; for a Gaussian part its log-std rows have zero weights and the
log-std as bias, so output 0 is [means, log-stds] from one Gemm. With an ``action_mask``
observation, masked logits become -1e9 inside the graph: no client can sample them.

The critic is the same network with its own weights (``vf.`` names) and a head of one
value; with ``shared`` (the default when there is an image) it shares the encoders and
trunk, as CleanRL's Atari agent does.

With ``memory`` ("lstm" or "gru") a recurrent core (``Recurrent``) sits between the trunk
and the heads, shared by actor and critic (the critic's state is then the actor's, which
is what the simulators carry). The graph takes the state before the step as inputs
``state_in.<i>`` and gives the state after it as outputs ``state_out.<i>``, float32
[batch, memory_size] each: for an LSTM 0 is h and 1 is c, for a GRU 0 is h. Zeros start
an episode. A net without ``memory`` has no state inputs or outputs at all.

This module imports torch only inside ``*_torch`` functions: simulators import it to
build nothing but the graph's inputs, never torch.
"""
from __future__ import annotations

import math

import numpy as np

from shmrl.onnxio.graph import (ACTION_DIST_KEY, FLOAT, INT64, ONNX_ACTIVATIONS, OUTPUT_NAME,  # noqa: F401
                                SQUASHED_GAUSSIAN, UINT8, Graph, ModelTemplate, orthogonal)
from shmrl.core.spaces import Leaf

OBS_CLIP = 10.0       # normalized observations are clipped to +-10, as VecNormalize does
LOG_STD_INIT = 0.0
MASKED_LOGIT = -1e9   # what a masked action's logit becomes: exp() of it is 0
HIDDEN_GAIN, POLICY_GAIN, VALUE_GAIN = math.sqrt(2), 0.01, 1.0


def _act_torch(x, activation):
    import torch.nn.functional as F

    return {"ReLU": F.relu, "Tanh": lambda t: t.tanh(), "Sigmoid": lambda t: t.sigmoid(), "ELU": F.elu}[activation](x)


# ------------------------------------------------------------------ layers

class Dense:
    """y = activation(x W^T + b); W in torch's [out, in] layout (Gemm transB=1)."""

    def __init__(self, name: str, n_in: int, n_out: int, activation: str | None, gain: float):
        self.name, self.n_in, self.n_out, self.activation, self.gain = name, n_in, n_out, activation, gain

    def params(self):
        return [(f"{self.name}.w", (self.n_out, self.n_in), self.gain), (f"{self.name}.b", (self.n_out,), 0.0)]

    def onnx(self, g: Graph, x: str, out: str | None = None) -> str:
        pre = g.node("Gemm", [x, f"{self.name}.w", f"{self.name}.b"], out if self.activation is None else None,
                     transB=1)
        return pre if self.activation is None else g.node(ONNX_ACTIVATIONS[self.activation], [pre], out)

    def torch(self, x, p):
        import torch.nn.functional as F

        y = F.linear(x, p[f"{self.name}.w"], p[f"{self.name}.b"])
        return y if self.activation is None else _act_torch(y, self.activation)


class Conv:
    """A 2-D convolution without padding over channels-first input, then the activation."""

    def __init__(self, name: str, c_in: int, c_out: int, kernel: int, stride: int, activation: str):
        self.name, self.c_in, self.c_out, self.kernel, self.stride = name, c_in, c_out, kernel, stride
        self.activation = activation

    def params(self):
        return [(f"{self.name}.w", (self.c_out, self.c_in, self.kernel, self.kernel), HIDDEN_GAIN),
                (f"{self.name}.b", (self.c_out,), 0.0)]

    def out_size(self, size: int) -> int:
        return (size - self.kernel) // self.stride + 1

    def onnx(self, g: Graph, x: str) -> str:
        y = g.node("Conv", [x, f"{self.name}.w", f"{self.name}.b"], kernel_shape=[self.kernel, self.kernel],
                   strides=[self.stride, self.stride])
        return g.node(ONNX_ACTIVATIONS[self.activation], [y])

    def torch(self, x, p):
        import torch.nn.functional as F

        return _act_torch(F.conv2d(x, p[f"{self.name}.w"], p[f"{self.name}.b"], stride=self.stride), self.activation)


class Encoder:
    """One observation leaf to a [batch, features] float matrix.

    ``normalized``: the leaf is normalized by running statistics (weights
    ``obs_mean.<leaf>`` and ``obs_inv_std.<leaf>``, not trained). The learner applies the
    normalization in numpy before its networks (``Normalizer``), so the torch rendering
    starts after it; the graph does it all."""

    def __init__(self, leaf: Leaf, prefix: str, normalized: bool, cnn: str):
        self.leaf, self.prefix, self.normalized = leaf, prefix, normalized
        self.convs: list[Conv] = []
        self.dense: Dense | None = None
        shape = leaf.shape
        if leaf.encoding == "image":
            chw = (shape if len(shape) == 3 else (1, *shape)) if _channels_first(shape) else \
                (shape[2] if len(shape) == 3 else 1, *shape[:2])
            c, h, w = chw
            if cnn == "nature" and min(h, w) >= 36:
                layout = [(32, 8, 4), (64, 4, 2), (64, 3, 1)]
            else:
                layout = [(16, 3, 1), (32, 3, 1)] if min(h, w) >= 5 else [(16, min(h, w), 1)]
            for i, (c_out, k, s) in enumerate(layout):
                conv = Conv(f"{prefix}.conv{i}", c, c_out, k, s, "ReLU")
                self.convs.append(conv)
                c, h, w = c_out, conv.out_size(h), conv.out_size(w)
            self.features = c * h * w
            if cnn == "nature" and self.convs[0].kernel == 8:   # the Nature CNN ends in 512 units
                self.dense = Dense(f"{prefix}.fc", self.features, 512, "ReLU", HIDDEN_GAIN)
                self.features = 512
        else:
            self.features = leaf.features

    def params(self):
        out = [p for conv in self.convs for p in conv.params()]
        return out + (self.dense.params() if self.dense else [])

    def stats(self):
        """Statistic weights of the graph: (name, shape) of the mean and inverse std."""
        if not self.normalized:
            return []
        return [(f"obs_mean.{self.leaf.name}", self.leaf.shape), (f"obs_inv_std.{self.leaf.name}", self.leaf.shape)]

    def onnx(self, g: Graph, x: str) -> str:
        leaf = self.leaf
        if leaf.encoding == "onehot":
            return g.node("Gather", [g.const(f"{self.prefix}.eye", np.eye(leaf.sizes[0], dtype=np.float32)), x])
        if leaf.encoding == "multi_onehot":
            parts = []
            for i, n in enumerate(leaf.sizes):
                column = g.node("Gather", [x, g.const(f"{self.prefix}.col{i}", np.array(i, np.int64))], axis=1)
                parts.append(g.node("Gather", [g.const(f"{self.prefix}.eye{i}", np.eye(n, dtype=np.float32)),
                                               column]))
            return g.node("Concat", parts, axis=1)
        if leaf.dtype != "float32":
            x = g.node("Cast", [x], to=FLOAT)
        if leaf.scale != 1.0:
            x = g.node("Mul", [x, g.const(f"{self.prefix}.scale", np.float32(leaf.scale))])
        if self.normalized:
            centred = g.node("Sub", [x, f"obs_mean.{leaf.name}"])
            scaled = g.node("Mul", [centred, f"obs_inv_std.{leaf.name}"])
            x = g.node("Clip", [scaled, g.const(f"{self.prefix}.clip_min", np.float32(-OBS_CLIP)),
                                g.const(f"{self.prefix}.clip_max", np.float32(OBS_CLIP))])
        if self.convs:
            if len(leaf.shape) == 2:
                x = g.node("Unsqueeze", [x, g.const(f"{self.prefix}.channel_axis", np.array([1], np.int64))])
            elif not _channels_first(leaf.shape):
                x = g.node("Transpose", [x], perm=[0, 3, 1, 2])
            for conv in self.convs:
                x = conv.onnx(g, x)
        if len(leaf.shape) != 1 or self.convs:
            x = g.node("Flatten", [x], axis=1)
        return self.dense.onnx(g, x) if self.dense else x

    def torch(self, x, p):
        import torch
        import torch.nn.functional as F

        leaf = self.leaf
        if leaf.encoding == "onehot":
            return F.one_hot(x.long(), leaf.sizes[0]).float()
        if leaf.encoding == "multi_onehot":
            return torch.cat([F.one_hot(x[:, i].long(), n).float() for i, n in enumerate(leaf.sizes)], dim=1)
        if not self.normalized:   # normalized leaves arrive as floats from the learner's numpy
            if leaf.dtype != "float32":
                x = x.float()
            if leaf.scale != 1.0:
                x = x * leaf.scale
        if self.convs:
            if len(leaf.shape) == 2:
                x = x.unsqueeze(1)
            elif not _channels_first(leaf.shape):
                x = x.permute(0, 3, 1, 2)
            for conv in self.convs:
                x = conv.torch(x, p)
        if len(leaf.shape) != 1 or self.convs:
            x = x.flatten(1)
        return self.dense.torch(x, p) if self.dense else x


class Recurrent:
    """An LSTM or GRU cell in torch's layout and gate order (LSTM: i, f, g, o; GRU: r, z, n),
    weights ``<name>.w_ih`` [gates * size, n_in], ``.w_hh`` [gates * size, size], ``.b_ih``,
    ``.b_hh``. The graph renders one step from elementary operators (Gemm, Split, Sigmoid,
    Tanh, Mul, Add, Sub), which every onnxruntime runs alike; torch runs a whole sequence
    with its own fused ``torch.lstm``/``torch.gru`` over the same weights. The state is
    flat, [batch, state_size]: an LSTM's h then c, a GRU's h."""

    def __init__(self, name: str, kind: str, n_in: int, size: int):
        if kind not in ("lstm", "gru"):
            raise ValueError(f"memory {kind!r} is not 'lstm' or 'gru'")
        self.name, self.kind, self.n_in, self.size = name, kind, n_in, size
        self.gates = 4 if kind == "lstm" else 3
        self.n_states = 2 if kind == "lstm" else 1
        self.state_size = self.n_states * size

    def params(self):
        n = self.gates * self.size
        return [(f"{self.name}.w_ih", (n, self.n_in), 1.0), (f"{self.name}.w_hh", (n, self.size), 1.0),
                (f"{self.name}.b_ih", (n,), 0.0), (f"{self.name}.b_hh", (n,), 0.0)]

    def onnx(self, g: Graph, x: str, states: list[str], outs: list[str]) -> str:
        """One step from ``x`` and the state inputs ``states``; writes ``outs``, returns h."""
        p = self.name
        gi = g.node("Gemm", [x, f"{p}.w_ih", f"{p}.b_ih"], transB=1)
        gh = g.node("Gemm", [states[0], f"{p}.w_hh", f"{p}.b_hh"], transB=1)
        if self.kind == "lstm":
            i, f, c_hat, o = (f"{p}.{gate}" for gate in ("i", "f", "g", "o"))
            g.node("Split", [g.node("Add", [gi, gh])], outputs=[i, f, c_hat, o], axis=1)
            c = g.node("Add", [g.node("Mul", [g.node("Sigmoid", [f]), states[1]]),
                               g.node("Mul", [g.node("Sigmoid", [i]), g.node("Tanh", [c_hat])])], outs[1])
            return g.node("Mul", [g.node("Sigmoid", [o]), g.node("Tanh", [c])], outs[0])
        xr, xz, xn, hr, hz, hn = (f"{p}.{gate}" for gate in ("xr", "xz", "xn", "hr", "hz", "hn"))
        g.node("Split", [gi], outputs=[xr, xz, xn], axis=1)
        g.node("Split", [gh], outputs=[hr, hz, hn], axis=1)
        r = g.node("Sigmoid", [g.node("Add", [xr, hr])])
        z = g.node("Sigmoid", [g.node("Add", [xz, hz])])
        n = g.node("Tanh", [g.node("Add", [xn, g.node("Mul", [r, hn])])])
        # h' = (1 - z) * n + z * h = n + z * (h - n)
        return g.node("Add", [n, g.node("Mul", [z, g.node("Sub", [states[0], n])])], outs[0])

    def torch(self, x, state, p):
        """(outputs [B, T, size], state after the last step [B, state_size]) for inputs
        [B, T, n_in] and the state before the first step [B, state_size]."""
        import torch

        weights = [p[f"{self.name}.{w}"] for w in ("w_ih", "w_hh", "b_ih", "b_hh")]
        h0 = state[:, :self.size].unsqueeze(0).contiguous()
        # Training mode where gradients flow: cuDNN refuses a backward through an RNN run in
        # inference mode (the CPU does not mind); with no dropout both compute the same.
        train = torch.is_grad_enabled()
        if self.kind == "lstm":
            c0 = state[:, self.size:].unsqueeze(0).contiguous()
            y, h, c = torch.lstm(x, (h0, c0), weights, True, 1, 0.0, train, False, True)
            return y, torch.cat([h[0], c[0]], dim=1)
        y, h = torch.gru(x, h0, weights, True, 1, 0.0, train, False, True)
        return y, h[0]


def _channels_first(shape: tuple) -> bool:
    from shmrl.core.spaces import image_layout

    return len(shape) == 3 and image_layout(shape) == "CHW"


# ------------------------------------------------------------------ the networks

class PolicyNet:
    """The actor (published as ONNX) and the critic (trained only) of an environment.

    Weights are a dict by name: ``enc.<leaf>...`` (encoders), ``pi.<i>`` (trunk),
    ``pi.head`` (the head, with a Gaussian's log-std rows), ``obs_mean.<leaf>`` and
    ``obs_inv_std.<leaf>`` (statistics); the critic's are ``vf.``-prefixed; the recurrent
    core's (with ``memory``) ``pi.core.``."""

    def __init__(self, spec, hidden: int = 64, activation: str = "Tanh", normalize_obs: bool = False,
                 log_std_init: float = LOG_STD_INIT, layers: int = 2, cnn: str = "nature",
                 shared: bool | None = None, memory: str | None = None, memory_size: int = 64,
                 ortho_init: bool = True):
        if activation not in ONNX_ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {sorted(ONNX_ACTIVATIONS)}")
        self.spec, self.hidden, self.activation, self.layers = spec, hidden, activation, layers
        self.normalize_obs, self.log_std_init, self.ortho_init = normalize_obs, log_std_init, ortho_init
        layout = spec.obs
        self.leaves = layout.inputs
        self.mask = layout.mask
        self.shared = any(leaf.encoding == "image" for leaf in self.leaves) if shared is None else shared
        self.shared = self.shared or memory is not None   # one core: the state clients carry is the critic's too
        # With --normalize-obs: every vector and image leaf (one-hot encodings are not).
        self.normalized = {leaf.name for leaf in self.leaves
                           if normalize_obs and leaf.encoding in ("vector", "image")}
        self.actor = self._tower("pi", cnn)
        self.critic = self.actor if self.shared else self._tower("vf", cnn)
        self.core = Recurrent("pi.core", memory, self.actor["trunk_out"], memory_size) if memory else None
        features = memory_size if memory else self.actor["trunk_out"]
        self.state_size = self.core.state_size if self.core else 0
        self.value_head = Dense("vf.head", features, 1, None, VALUE_GAIN)
        # Rows of the head the actor trains (logits, means) and the log-std rows it does not.
        self.trained_rows, self.log_std_rows = _head_rows(spec.actions)
        self.policy_head = Dense("pi.head", features, len(self.trained_rows), None, POLICY_GAIN)
        # Where a mask's columns are among the trained rows (a Box part's log-stds are not).
        position = {row: i for i, row in enumerate(self.trained_rows.tolist())}
        self._mask_trained_columns = _LazyIndex([position[c] for c in spec.actions.mask_columns.tolist()])
        self.template: ModelTemplate = self.graph().template()

    def _tower(self, prefix: str, cnn: str) -> dict:
        """Encoders and trunk, weights named ``<prefix>.``."""
        encoders = [Encoder(leaf, f"{prefix}.enc.{leaf.name}", leaf.name in self.normalized, cnn)
                    for leaf in self.leaves]
        n = sum(e.features for e in encoders)
        trunk = []
        for i in range(self.layers):
            trunk.append(Dense(f"{prefix}.{i}", n, self.hidden, self.activation, HIDDEN_GAIN))
            n = self.hidden
        return {"encoders": encoders, "trunk": trunk, "trunk_out": n}

    # -------------------------------------------------------- weights
    def trained_params(self) -> list[tuple[str, tuple, float]]:
        """(name, shape, init gain) of every trained weight, actor first, then the critic's."""
        actor = [p for e in self.actor["encoders"] for p in e.params()]
        actor += [p for d in self.actor["trunk"] for p in d.params()] + self._core_params()
        actor += self.policy_head.params()
        critic = [] if self.shared else [p for e in self.critic["encoders"] for p in e.params()] + \
            [p for d in self.critic["trunk"] for p in d.params()]
        return actor + critic + self.value_head.params()

    def _core_params(self):
        return self.core.params() if self.core else []

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        """Orthogonal weights (gain sqrt 2 in hidden layers, 0.01 for the policy head so its
        first actions are near uniform or near zero, 1 for the value head), zero biases; or,
        without ``ortho_init``, torch's default for every layer (weights and biases uniform
        within 1/sqrt(inputs), as stable-baselines3 with ortho_init=False has them)."""
        # The critic draws from a stream of its own: the actor is the same with or without it.
        actor_rng, critic_rng = np.random.default_rng(seed), np.random.default_rng([seed, 1])
        out, fan_in = {}, 1
        for name, shape, gain in self.trained_params():
            rng = critic_rng if name.startswith("vf.") else actor_rng
            if not self.ortho_init:
                fan_in = math.prod(shape[1:]) if len(shape) > 1 else fan_in   # a bias follows its weights
                bound = 1 / math.sqrt(fan_in)
                out[name] = rng.uniform(-bound, bound, shape).astype(np.float32)
            else:
                out[name] = orthogonal(shape, gain, rng) if len(shape) > 1 else np.zeros(shape, np.float32)
        return out

    def publish_weights(self, params: dict[str, np.ndarray], log_std: np.ndarray | None,
                        stats: dict[str, tuple] | None = None) -> dict[str, np.ndarray]:
        """The graph's weights: the actor's ``params`` with the log-std rows put into the
        head, and the observation ``stats`` ({leaf: (mean, var)}; absent: mean 0, var 1)."""
        out = {name: params[name] for name, _, _ in self.trained_params()
               if not name.startswith("vf.") and not name.startswith("pi.head")}
        w, b = params["pi.head.w"], params["pi.head.b"]
        head_w = np.zeros((self.spec.actions.dist_size, w.shape[1]), np.float32)
        head_b = np.zeros(self.spec.actions.dist_size, np.float32)
        head_w[self.trained_rows], head_b[self.trained_rows] = w, b
        if len(self.log_std_rows):
            head_b[self.log_std_rows] = log_std
        out["pi.head.w"], out["pi.head.b"] = head_w, head_b
        for leaf in self.leaves:
            if leaf.name in self.normalized:
                mean, var = (stats or {}).get(leaf.name, (np.zeros(leaf.shape), np.ones(leaf.shape)))
                out[f"obs_mean.{leaf.name}"] = np.asarray(mean, np.float32)
                out[f"obs_inv_std.{leaf.name}"] = (1.0 / np.sqrt(np.asarray(var, np.float64) + 1e-8)).astype(np.float32)
        return out

    def initial_weights(self, seed: int) -> dict[str, np.ndarray]:
        """The first published policy (before torch is loaded)."""
        return self.publish_weights(self.init_params(seed), np.full(len(self.log_std_rows), self.log_std_init))

    def split_published(self, weights: dict[str, np.ndarray]) -> tuple[dict, np.ndarray]:
        """The actor's trained params and log-std from published weights (a checkpoint's)."""
        params = {k: v for k, v in weights.items() if not k.startswith("obs_")}
        params["pi.head.w"] = weights["pi.head.w"][self.trained_rows]
        params["pi.head.b"] = weights["pi.head.b"][self.trained_rows]
        return params, weights["pi.head.b"][self.log_std_rows]

    def check(self, weights: dict[str, np.ndarray]) -> str | None:
        """Why ``weights`` (a checkpoint's published policy) do not fit this network, or None."""
        for name, shape in self.template.shapes.items():
            if name not in weights:
                return f"it has no {name!r} (saved with another network or without observation normalization?)"
            if weights[name].shape != shape:
                return f"its {name!r} has shape {weights[name].shape}, this network's {shape}"
        extra = set(weights) - set(self.template.shapes)
        return f"it has {sorted(extra)}, this network does not" if extra else None

    # -------------------------------------------------------- the graph
    def graph(self) -> Graph:
        g = Graph()
        elem = {"float32": FLOAT, "uint8": UINT8, "int64": INT64}
        inputs = {leaf.name: g.input(leaf.input_name, ["batch", *leaf.shape], elem[leaf.dtype]) for leaf in self.leaves}
        mask = g.input(self.mask.input_name, ["batch", *self.mask.shape], UINT8) if self.mask else None
        states = [g.input(name, ["batch", self.core.size]) for name in self.state_names("in")]
        for name, shape in self._graph_params():
            g.param(name, shape)
        x = self._onnx_tower(g, self.actor, inputs)
        if self.core:
            x = self.core.onnx(g, x, states, self.state_names("out"))
        out = self.policy_head_full(g, x, masked=mask is not None)
        if mask is not None:
            allowed = g.node("Cast", [mask], to=FLOAT)
            penalty = g.node("Mul", [g.node("Sub", [allowed, g.const("mask.one", np.float32(1.0))]),
                                     g.const("mask.scale", np.float32(-MASKED_LOGIT))])
            columns = self.spec.actions.mask_columns
            if len(columns) != self.spec.actions.dist_size:   # a Box part beside: spread to its columns
                spread = np.zeros((len(columns), self.spec.actions.dist_size), np.float32)
                spread[np.arange(len(columns)), columns] = 1.0
                penalty = g.node("MatMul", [penalty, g.const("mask.spread", spread)])
            g.node("Add", [out, penalty], OUTPUT_NAME)
        g.output(OUTPUT_NAME, ["batch", self.spec.actions.dist_size])
        for name in self.state_names("out"):
            g.output(name, ["batch", self.core.size])
        return g

    def state_names(self, direction: str) -> list[str]:
        """The graph's ``state_in.<i>`` inputs or ``state_out.<i>`` outputs (none without memory)."""
        return [f"state_{direction}.{i}" for i in range(self.core.n_states)] if self.core else []

    def _graph_params(self):
        """(name, shape) of every weight of the graph, in the order the template lists them."""
        out = []
        for e in self.actor["encoders"]:
            out += e.stats() + [(n, s) for n, s, _ in e.params()]
        out += [(n, s) for d in self.actor["trunk"] for n, s, _ in d.params()]
        out += [(n, s) for n, s, _ in self._core_params()]
        return out + [("pi.head.w", (self.spec.actions.dist_size, self.policy_head.n_in)),
                      ("pi.head.b", (self.spec.actions.dist_size,))]

    def _onnx_tower(self, g: Graph, tower: dict, inputs: dict) -> str:
        features = [e.onnx(g, inputs[e.leaf.name]) for e in tower["encoders"]]
        x = features[0] if len(features) == 1 else g.node("Concat", features, axis=1)
        for dense in tower["trunk"]:
            x = dense.onnx(g, x)
        return x

    def policy_head_full(self, g: Graph, x: str, masked: bool) -> str:
        return g.node("Gemm", [x, "pi.head.w", "pi.head.b"], None if masked else OUTPUT_NAME, transB=1)

    @property
    def convolutional(self) -> bool:
        """Whether an encoder convolves (an image leaf): the update a GPU makes far faster."""
        return any(e.convs for e in self.actor["encoders"])

    # -------------------------------------------------------- torch (the learner)
    def _torch_tower(self, tower: dict, p: dict, obs: dict):
        import torch

        features = [e.torch(obs[e.leaf.name], p) for e in tower["encoders"]]
        x = features[0] if len(features) == 1 else torch.cat(features, dim=1)
        for dense in tower["trunk"]:
            x = dense.torch(x, p)
        return x

    def actor_torch(self, p: dict, obs: dict):
        """The head's trained rows (logits and means) for ``obs`` ({leaf: tensor}); masked
        logits set as the graph sets them."""
        return self._masked(self.policy_head.torch(self._torch_tower(self.actor, p, obs), p), obs)

    def _masked(self, out, obs):
        """The head's output with -1e9 added to the logits a mask forbids, as the graph does."""
        if self.mask is None:
            return out
        penalty = (obs[self.mask.name].float() - 1.0) * -MASKED_LOGIT
        if penalty.shape[1] == out.shape[1]:
            return out + penalty
        return out.index_add(1, self._mask_trained_columns.tensor(out.device), penalty)

    def critic_torch(self, p: dict, obs: dict):
        return self.value_head.torch(self._torch_tower(self.critic, p, obs), p).squeeze(-1)

    def both_torch(self, p: dict, obs: dict):
        """(actor output, values) in one pass through a shared encoder and trunk."""
        if not self.shared:
            return self.actor_torch(p, obs), self.critic_torch(p, obs)
        x = self._torch_tower(self.actor, p, obs)
        return self._masked(self.policy_head.torch(x, p), obs), self.value_head.torch(x, p).squeeze(-1)


    def sequence_torch(self, p: dict, obs: dict, state):
        """(actor output, values, state after) for ``B`` sequences of ``T`` steps each, with
        the recurrent core: ``obs`` rows sequence by sequence ([B * T] rows, sequence b's at
        b * T ...), ``state`` [B, state_size] the state before each one's first step."""
        x = self._torch_tower(self.actor, p, obs)
        batch = len(state)
        y, state = self.core.torch(x.reshape(batch, len(x) // batch, x.shape[-1]), state, p)
        y = y.reshape(len(x), y.shape[-1])
        return self._masked(self.policy_head.torch(y, p), obs), self.value_head.torch(y, p).squeeze(-1), state


class SquashedGaussianNet(PolicyNet):
    """SAC's actor: the same encoders and trunk, a head of 2 x |A| trained rows (means, then
    log-stds, state-dependent), the log-stds clamped to [LOG_STD_MIN, LOG_STD_MAX] inside
    the graph (Min, Max) as in torch. Output 0 is (mean, log_std) before the squash; a client
    samples u ~ N(mean, exp(log_std)) and acts low + (tanh(u) + 1) / 2 x (high - low)
    (``shmrl.client.action_sampler``): the model's metadata says so (``action_dist``:
    ``squashed_gaussian``). Its critic tower (``vf.``) is unused: SAC's Q-networks take
    the action too (``shmrl.model.sac``)."""

    LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0   # stable-baselines3's
    BIG = 3.0e38                            # a bound that never binds (the means')

    def __init__(self, spec, *args, **kwargs):
        super().__init__(spec, *args, **kwargs)
        d = spec.actions.action_size
        self.trained_rows, self.log_std_rows = np.arange(2 * d), np.arange(0)
        self.policy_head = Dense("pi.head", self.policy_head.n_in, 2 * d, None, POLICY_GAIN)
        self.template = self.graph().template()

    def graph(self) -> Graph:
        g = super().graph()
        g.metadata[ACTION_DIST_KEY] = SQUASHED_GAUSSIAN
        return g

    def policy_head_full(self, g: Graph, x: str, masked: bool) -> str:
        d = self.spec.actions.action_size
        hi = np.concatenate([np.full(d, self.BIG), np.full(d, self.LOG_STD_MAX)]).astype(np.float32)
        lo = np.concatenate([np.full(d, -self.BIG), np.full(d, self.LOG_STD_MIN)]).astype(np.float32)
        out = g.node("Gemm", [x, "pi.head.w", "pi.head.b"], transB=1)
        out = g.node("Min", [out, g.const("pi.log_std_max", hi)])
        return g.node("Max", [out, g.const("pi.log_std_min", lo)], OUTPUT_NAME)

    def actor_torch(self, p: dict, obs: dict):
        """(mean, log_std) side by side, the log-stds clamped as the graph clamps them."""
        import torch

        out = self.policy_head.torch(self._torch_tower(self.actor, p, obs), p)
        d = out.shape[1] // 2
        return torch.cat([out[:, :d], out[:, d:].clamp(self.LOG_STD_MIN, self.LOG_STD_MAX)], dim=1)


class _LazyIndex:
    """Integers as a torch.long tensor on the device asked, made on first use (simulators
    never use it)."""

    def __init__(self, values: list):
        self.values, self._tensor = values, None

    def tensor(self, device=None):
        import torch

        if self._tensor is None or (device is not None and self._tensor.device != torch.device(device)):
            self._tensor = torch.tensor(self.values, dtype=torch.long, device=device)
        return self._tensor


def _head_rows(layout) -> tuple[np.ndarray, np.ndarray]:
    trained, log_std = [], []
    d = 0
    for part in layout.parts:
        if part.kind == "categorical":
            trained += range(d, d + part.size)
        else:
            trained += range(d, d + part.size)
            log_std += range(d + part.size, d + 2 * part.size)
        d += part.dist_size
    return np.array(trained, np.int64), np.array(log_std, np.int64)
