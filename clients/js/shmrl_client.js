'use strict';
/**
 * An RLlink client for shmrl in JavaScript (Node >= 18): everything a simulator written in
 * JS needs to train against `python -m shmrl.run --tcp-port P`. The protocol is
 * docs/RLLINK.md (section numbers below are its); docs/CLIENTS.md walks through this file.
 *
 *   framing                 8 ASCII digits, then the body (section 1)
 *   handshake               PING (codecs, client_name, auth_token) -> PONG, GET_CONFIG ->
 *                           SET_CONFIG, GET_STATE -> SET_STATE (sections 2, 3)
 *   codecs                  JSON, and the binary codec (section 7) once the PONG agreed on it
 *   the policy              SET_STATE's onnx_file: base64 -> gunzip -> onnxruntime-node
 *   sampling                from output 0, action_dist_inputs (section 4.2): RLlib's categorical and
 *                           Gaussian, and SAC's squashed Gaussian and uniform warm-up where SET_CONFIG
 *                           and SET_STATE name them in action_dist (the PING says it samples them)
 *   chunks                  obs = actions + 1; a running episode continues in the next
 *                           message from its last obs, under the same episode_id (section 4)
 *   heartbeats              when binary was agreed (section 5)
 *   reconnecting            with a bounded backoff; the session is over (exit 0) when the
 *                           server stays away after it closed the connection
 *   server-side inference   `inference: 'server'`: ACT with K observations -> ACTIONS (section 11),
 *                           no onnxruntime needed
 *
 * Only `onnxruntime-node` is needed beyond Node itself.
 */
const net = require('node:net');
const zlib = require('node:zlib');

const MAGIC = Buffer.from([0x93, 0x52, 0x4c, 0x42]);       // 0x93 "RLB": a binary body
const MAX_REPLY_BYTES = 256 * 1024 * 1024;                  // never trust a header (section 1)
// Every shmrl client's (REPLY_TIMEOUT_S and GIVE_UP_S in shmrl/config/faces.py; the C header's
// and docs/CLIENTS.md's are the same, which tests/test_client_numbers.py checks):
const REPLY_TIMEOUT_S = 600;   // seconds to wait for a reply: a strict on-policy server holds it through an update
const GIVE_UP_S = 5;           // seconds a client keeps trying a server that went away after a session
const DTYPES = {                                            // binary codec dtypes (section 7)
  '<f4': Float32Array, '<f8': Float64Array, '<i4': Int32Array, '<i8': BigInt64Array,
  '|u1': Uint8Array, '|b1': Uint8Array,
};

// The distributions beyond RLlib's that Sampler samples: the PING of a client that runs the policy
// lists them (`action_dists`, RLLINK.md section 3.1), or a --algo sac learner refuses it.
const ACTION_DISTS = ['squashed_gaussian', 'uniform'];
const LOG_2 = Math.log(2);
const HALF_LOG_2PI = 0.5 * Math.log(2 * Math.PI);

class ConnectionClosed extends Error {}
class ProtocolError extends Error {}

// ------------------------------------------------------------------ the binary codec

/** An array for the binary codec: dtype (a key of DTYPES), shape, and a typed array of
 * product(shape) elements in C order. */
class NdArray {
  constructor(dtype, shape, data) {
    this.dtype = dtype;
    this.shape = shape;
    this.data = data;
  }
}

/** A message's chunks as columns (section 7's `__cols__`). */
class Columns {
  constructor(columns) { this.columns = columns; }
}

const align8 = (n) => Math.ceil(n / 8) * 8;

/** A list of floats: written with a decimal point even when integral (1.0, not 1), as
 * Python writes them (the server would take 1 as well: RLLINK.md section 4, Numbers). */
class Floats extends Array {}

const floatText = (v) => (Number.isInteger(v) ? v.toFixed(1) : String(v));

/** JSON text of a value (Python's separators). Columns become the list form of section 4;
 * numbers must be finite (NaN would make invalid JSON, which the server refuses). */
function jsonText(v) {
  if (v instanceof Floats) return `[${v.map(floatText).join(', ')}]`;
  if (Array.isArray(v)) return `[${v.map(jsonText).join(', ')}]`;
  if (v instanceof NdArray) return jsonText(nestedList(v));
  if (v instanceof Columns) return jsonText(columnsToChunks(v.columns));
  if (typeof v === 'bigint') return v.toString();
  if (v !== null && typeof v === 'object') {
    const fields = Object.entries(v).filter(([, x]) => x !== undefined);
    return `{${fields.map(([k, x]) => `${JSON.stringify(k)}: ${jsonText(x)}`).join(', ')}}`;
  }
  return JSON.stringify(v);
}

/** The body of `msg` in JSON. */
function encodeJson(msg) {
  return Buffer.from(jsonText(msg), 'utf8');
}

/** The binary body of `msg`: a JSON head in which each NdArray is a descriptor
 * {"__nd__": [dtype, shape, offset, nbytes]}, then the blocks, each 8-aligned. */
function encodeBinary(msg) {
  const blocks = [];
  let size = 0;
  const head = Buffer.from(JSON.stringify(msg, (key, value) => {
    if (value instanceof Columns) return { __cols__: value.columns };
    if (!(value instanceof NdArray)) return value;
    const bytes = Buffer.from(value.data.buffer, value.data.byteOffset, value.data.byteLength);
    const offset = size;
    blocks.push(bytes, Buffer.alloc(align8(bytes.length) - bytes.length));
    size += align8(bytes.length);
    return { __nd__: [value.dtype, value.shape, offset, bytes.length] };
  }), 'utf8');
  const preamble = Buffer.alloc(8);
  MAGIC.copy(preamble, 0);
  preamble.writeUInt32LE(head.length, 4);
  const pad = Buffer.alloc(align8(8 + head.length) - 8 - head.length);
  return Buffer.concat([preamble, head, pad, ...blocks]);
}

/** A reply body (JSON or binary) as an object; binary arrays become NdArrays. */
function decodeBody(body) {
  if (body.length >= 4 && body.subarray(0, 4).equals(MAGIC)) {
    if (body.length < 8) throw new ProtocolError('binary body shorter than its preamble');
    const headLen = body.readUInt32LE(4);
    const dataStart = align8(8 + headLen);
    if (dataStart > body.length) throw new ProtocolError('binary head overruns the body');
    return JSON.parse(body.subarray(8, 8 + headLen).toString('utf8'), (key, value) => {
      if (value === null || typeof value !== 'object' || !('__nd__' in value)) return value;
      const [dtype, shape, offset, nbytes] = value.__nd__;
      const Type = DTYPES[dtype];
      if (!Type || dataStart + offset + nbytes > body.length) throw new ProtocolError(`bad array descriptor ${JSON.stringify(value)}`);
      const copy = Uint8Array.prototype.slice.call(body, dataStart + offset, dataStart + offset + nbytes);
      return new NdArray(dtype, shape, new Type(copy.buffer));   // a copy: aligned for any dtype
    });
  }
  return JSON.parse(body.toString('utf8'));
}

/** An NdArray as nested lists (BigInts as numbers, bools as booleans, floats as Floats). */
function nestedList(arr) {
  const values = Array.from(arr.data, (v) => (arr.dtype === '|b1' ? v !== 0 : Number(v)));
  const List = arr.dtype[1] === 'f' ? Floats : Array;
  const build = (dims, start) => {
    if (dims.length === 0) return values[start];
    const stride = dims.slice(1).reduce((a, b) => a * b, 1);
    return (dims.length === 1 ? List : Array).from({ length: dims[0] }, (_, i) => build(dims.slice(1), start + i * stride));
  };
  return build(arr.shape, 0);
}

/** Section 7's columns back to section 4's list of chunks, for a JSON message. */
function columnsToChunks(cols) {
  const rows = (name) => nestedList(cols[name]);
  const [obs, actions, rewards, dist, logp] = ['obs', 'actions', 'rewards', 'action_dist_inputs', 'action_logp'].map(rows);
  const [terminated, truncated] = [rows('is_terminated'), rows('is_truncated')];
  const seqs = cols.weights_seq_no ? rows('weights_seq_no') : null;
  const chunks = [];
  let step = 0;
  let row = 0;
  rows('lengths').forEach((n, i) => {
    const chunk = {
      obs: obs.slice(row, row + n + 1), actions: actions.slice(step, step + n),
      rewards: rewards.slice(step, step + n), action_dist_inputs: dist.slice(step, step + n),
      action_logp: logp.slice(step, step + n), is_terminated: terminated[i], is_truncated: truncated[i],
    };
    if (cols.episode_id) chunk.episode_id = cols.episode_id[i];
    if (seqs && seqs[i] >= 0) chunk.weights_seq_no = seqs[i];
    chunks.push(chunk);
    step += n;
    row += n + 1;
  });
  return chunks;
}

// ------------------------------------------------------------------ framing and the connection

/** One TCP connection: frames out, frames in, one reply per request. */
class Connection {
  static open(host, port, { connectTimeoutS = 10 } = {}) {
    return new Promise((resolve, reject) => {
      const socket = net.createConnection({ host, port });
      const timer = setTimeout(() => socket.destroy(new ConnectionClosed(`cannot connect to ${host}:${port} in ${connectTimeoutS} s`)), connectTimeoutS * 1000);
      socket.once('connect', () => { clearTimeout(timer); socket.removeAllListeners('error'); resolve(new Connection(socket)); });
      socket.once('error', (e) => { clearTimeout(timer); reject(new ConnectionClosed(e.message)); });
    });
  }

  constructor(socket) {
    this.socket = socket;
    this.socket.setNoDelay(true);             // small frames, each waited for (section 1)
    this.codec = 'json';                      // what we send: binary once the PONG agreed
    this.heartbeatS = null;
    this.lastSent = Date.now();
    this.buffered = [];
    this.bufferedBytes = 0;
    this.closed = null;                       // why the connection ended, once it has
    this.waiter = null;
    socket.on('data', (data) => { this.buffered.push(data); this.bufferedBytes += data.length; this.wake(); });
    socket.on('error', (e) => { this.closed = this.closed || e.message; this.wake(); });
    socket.on('close', () => { this.closed = this.closed || 'the server closed the connection'; this.wake(); });
  }

  wake() {
    if (this.waiter) { const w = this.waiter; this.waiter = null; w(); }
  }

  /** Send a request; a reply, if it has one, is read with `reply`. */
  send(msg) {
    if (this.closed) throw new ConnectionClosed(this.closed);
    const body = this.codec === 'binary' ? encodeBinary(msg) : encodeJson(msg);
    this.socket.write(Buffer.concat([Buffer.from(String(body.length).padStart(8, '0'), 'ascii'), body]));
    this.lastSent = Date.now();
  }

  /** Take n bytes once they have arrived (or the timeout passes, or the connection ends). */
  async take(n, deadline) {
    while (this.bufferedBytes < n) {
      if (this.closed) throw new ConnectionClosed(this.closed);
      const left = deadline - Date.now();
      if (left <= 0) throw new ConnectionClosed('no reply in time');
      await new Promise((resolve) => {
        const timer = setTimeout(resolve, left);
        this.waiter = () => { clearTimeout(timer); resolve(); };
      });
    }
    const all = Buffer.concat(this.buffered);
    this.buffered = all.length > n ? [all.subarray(n)] : [];
    this.bufferedBytes = all.length - n;
    return all.subarray(0, n);
  }

  /** The next frame's body, decoded. */
  async reply(timeoutS) {
    const deadline = Date.now() + timeoutS * 1000;
    const header = (await this.take(8, deadline)).toString('latin1');
    if (!/^[0-9]{8}$/.test(header)) throw new ProtocolError(`bad frame header ${JSON.stringify(header)}`);
    const length = Number(header);
    if (length > MAX_REPLY_BYTES) throw new ProtocolError(`reply of ${length} bytes is too large`);
    return decodeBody(await this.take(length, deadline));
  }

  /** Send `msg` and return its reply, which must be of type `expect`. */
  async request(msg, expect, timeoutS) {
    this.send(msg);
    const reply = await this.reply(timeoutS);
    if (reply.type !== expect) throw new ProtocolError(`expected ${expect}, got ${reply.type}`);
    return reply;
  }

  /** A HEARTBEAT when one is due (section 5): nothing sent for heartbeat_s. */
  heartbeat(envSteps) {
    if (this.heartbeatS !== null && Date.now() - this.lastSent >= this.heartbeatS * 1000) {
      this.send({ type: 'HEARTBEAT', env_steps: envSteps });
    }
  }

  close() { this.socket.destroy(); }
}

/** PING -> PONG, GET_CONFIG -> SET_CONFIG, GET_STATE -> SET_STATE (sections 2, 3); with
 * `inference: 'server'` the PING asks the server to run the policy (section 11) and there is
 * no GET_STATE (`state` is null). With `space` ({obsSize, action}) the GET_CONFIG declares
 * the env's spaces. */
async function handshake(conn, { codec = 'binary', clientName = null, authToken = null, timeoutS = REPLY_TIMEOUT_S, inference = 'client', space = null } = {}) {
  const ping = { type: 'PING' };
  if (authToken) ping.auth_token = authToken;
  if (codec === 'binary') ping.codecs = ['binary'];
  if (clientName) ping.client_name = clientName;
  if (inference === 'server') ping.inference = 'server'; else ping.action_dists = ACTION_DISTS;
  const pong = await conn.request(ping, 'PONG', timeoutS);
  if (pong.codec !== undefined) {
    if (pong.codec !== 'binary' || codec !== 'binary') throw new ProtocolError(`PONG names codec ${pong.codec}, which was not offered`);
    conn.codec = 'binary';
    conn.heartbeatS = typeof pong.heartbeat_s === 'number' ? pong.heartbeat_s : null;
  }
  if (inference === 'server' && pong.inference !== 'server') {
    throw new ProtocolError("the server does not serve actions (its PONG did not grant 'inference': 'server'); run without --server-inference");
  }
  // The env's spaces declared (RLLINK.md 3.2): a learner started without --env trains them.
  const declared = space ? { observation_shape: [space.obsSize], observation_dtype: '<f4', action_space: space.action } : {};
  const config = await conn.request({ type: 'GET_CONFIG', ...declared }, 'SET_CONFIG', timeoutS);
  // What this client does not do, named here rather than failing later in a reply it cannot read.
  const unsupported = config.observation_leaves !== undefined ? 'Dict or Tuple observations (SET_CONFIG observation_leaves)'
    : config.policy_map !== undefined ? 'multi-agent envs (SET_CONFIG policy_map)' : null;
  if (unsupported) {
    throw new ProtocolError(`this client does not support ${unsupported}; the Python client (python -m shmrl.sim --connect) `
      + 'and examples/external_client.py do');
  }
  const state = inference === 'server' ? null : await conn.request({ type: 'GET_STATE' }, 'SET_STATE', timeoutS);
  return { config, state };
}

// ------------------------------------------------------------------ the policy and sampling

/** The ONNX model of a SET_STATE: base64 -> gunzip -> onnxruntime-node (section 3.3). */
class Policy {
  static async load(ort, setState) {
    if (typeof setState.onnx_file !== 'string') throw new ProtocolError('SET_STATE without onnx_file (a multi-agent run?) is not supported');
    const model = zlib.gunzipSync(Buffer.from(setState.onnx_file, 'base64'));
    const session = await ort.InferenceSession.create(model, {
      executionProviders: ['cpu'], intraOpNumThreads: 1, interOpNumThreads: 1,
    });
    if (session.inputNames.some((name) => name.startsWith('state_in.'))) {
      throw new ProtocolError('a recurrent policy (state_in inputs) is not supported by this client');
    }
    return new Policy(ort, session, setState.weights_seq_no);
  }

  constructor(ort, session, version) {
    this.ort = ort;
    this.session = session;
    this.version = version;
    this.input = session.inputNames[0];       // onnx::Gemm_0 for a flat Box observation
  }

  /** Output 0 (action_dist_inputs) for K observations: a Float32Array [K, width]. */
  async distInputs(obs, k) {
    const feeds = { [this.input]: new this.ort.Tensor('float32', obs, [k, obs.length / k]) };
    const out = await this.session.run(feeds);
    return out[this.session.outputNames[0]].data;
  }
}

/** A seeded uniform [0, 1) generator (mulberry32): runs can be repeated. */
function seededRandom(seed) {
  let a = (seed >>> 0) || 0x9e3779b9;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** softplus(x) = log(1 + e^x), without overflow for large x. */
const softplus = (x) => (x > 0 ? x + Math.log1p(Math.exp(-x)) : Math.log1p(Math.exp(x)));

/** Sampling from output 0 (section 4.2), for a Discrete(n) or a Box of d dimensions.
 * `sample(dist, offset)` returns [action, logp]: an int, or an array of d floats. A Box is
 * sampled as `setDist` says (SET_CONFIG's and SET_STATE's action_dist): RLlib's Gaussian
 * (unclipped: the env clips what it applies), SAC's squashed Gaussian or uniform within the
 * bounds (both inside [low, high]); those two need the Box's finite low and high. */
class Sampler {
  constructor(actionSpace, random, dist = null) {
    this.space = actionSpace;
    this.random = random;
    this.width = actionSpace.type === 'Discrete' ? actionSpace.n : 2 * actionSpace.shape[0];
    this.dist = 'gaussian';
    this.setDist(dist);
  }

  /** Sample a Box as `dist`: 'squashed_gaussian', 'uniform', or null/undefined for RLlib's Gaussian. */
  setDist(dist) {
    const name = dist || 'gaussian';
    if (name === this.dist) return;
    if (!['gaussian', ...ACTION_DISTS].includes(name)) throw new ProtocolError(`action_dist ${JSON.stringify(dist)} is not one this client samples (${ACTION_DISTS.join(', ')})`);
    if (name !== 'gaussian') {
      const { type, shape, low, high } = this.space;
      const d = type === 'Box' ? shape[0] : 0;
      const bounded = d > 0 && Array.isArray(low) && Array.isArray(high) && low.length === d && high.length === d
        && low.every((l, i) => Number.isFinite(l) && Number.isFinite(high[i]) && l < high[i]);
      if (!bounded) throw new ProtocolError(`action_dist ${name} needs a Box action space with finite low < high, not ${JSON.stringify(this.space)}`);
      this.low = low;
      this.range = low.map((l, i) => high[i] - l);
      this.logHalfRange = this.range.reduce((acc, r) => acc + Math.log(r / 2), 0);
      this.logRange = this.range.reduce((acc, r) => acc + Math.log(r), 0);
    }
    this.dist = name;
  }

  sample(dist, offset) {
    if (this.space.type === 'Discrete') return this.categorical(dist, offset, this.space.n);
    const d = this.space.shape[0];
    if (this.dist === 'squashed_gaussian') return this.squashed(dist, offset, d);
    if (this.dist === 'uniform') return this.uniform(d);
    return this.gaussian(dist, offset, d);
  }

  /** a ~ softmax(logits); logp = logits[a] - logsumexp(logits). */
  categorical(dist, offset, n) {
    let max = -Infinity;
    for (let i = 0; i < n; i++) max = Math.max(max, dist[offset + i]);
    let total = 0;
    for (let i = 0; i < n; i++) total += Math.exp(dist[offset + i] - max);
    let u = this.random() * total;
    let action = n - 1;
    for (let i = 0; i < n; i++) {
      u -= Math.exp(dist[offset + i] - max);
      if (u < 0) { action = i; break; }
    }
    return [action, dist[offset + action] - max - Math.log(total)];
  }

  /** z ~ N(0, 1) (Box-Muller). */
  normal() {
    return Math.sqrt(-2 * Math.log(1 - this.random())) * Math.cos(2 * Math.PI * this.random());
  }

  /** a = mean + exp(log_std) * z, z ~ N(0, 1); logp = sum(-z^2/2 - log_std - log(2 pi)/2). */
  gaussian(dist, offset, d) {
    const action = new Array(d);
    let logp = 0;
    for (let i = 0; i < d; i++) {
      const z = this.normal();
      const logStd = dist[offset + d + i];
      action[i] = dist[offset + i] + Math.exp(logStd) * z;
      logp += -0.5 * z * z - logStd - HALF_LOG_2PI;
    }
    return [action, logp];
  }

  /** SAC's: u = mean + exp(log_std) * z, a = low + (tanh(u) + 1) / 2 * (high - low);
   * logp = the Gaussian's of u - sum(log(1 - tanh(u)^2)) - sum(log((high - low) / 2)), with
   * log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u)) (exact near the bounds). */
  squashed(dist, offset, d) {
    const action = new Array(d);
    let logp = -this.logHalfRange;
    for (let i = 0; i < d; i++) {
      const z = this.normal();
      const logStd = dist[offset + d + i];
      const u = dist[offset + i] + Math.exp(logStd) * z;
      action[i] = this.low[i] + (Math.tanh(u) + 1) / 2 * this.range[i];
      logp += -0.5 * z * z - logStd - HALF_LOG_2PI - 2 * (LOG_2 - u - softplus(-2 * u));
    }
    return [action, logp];
  }

  /** SAC's warm-up: a uniform within [low, high] whatever output 0 says; logp = -sum(log(high - low)). */
  uniform(d) {
    const action = new Array(d);
    for (let i = 0; i < d; i++) action[i] = this.low[i] + this.random() * this.range[i];
    return [action, -this.logRange];
  }
}

// ------------------------------------------------------------------ recording chunks

/** K envs' steps, cut into chunks (section 4): each env's open chunk holds its first obs
 * and the steps since; a finished episode's chunk goes out with its flags, a running one
 * goes out at the end of the message and continues from its last obs. */
class Recorder {
  constructor(k, obsSize, distWidth, idPrefix) {
    Object.assign(this, { k, obsSize, distWidth, idPrefix, episodes: 0 });
    this.open = [];
    this.done = [];
  }

  start(env, obs) {
    this.open[env] = { id: `${this.idPrefix}-${this.episodes++}`, obs: [Float32Array.from(obs)], actions: [], rewards: [], dist: [], logp: [] };
  }

  record(env, action, dist, logp, reward, nextObs) {
    const chunk = this.open[env];
    chunk.actions.push(action);
    chunk.dist.push(dist);
    chunk.logp.push(logp);
    chunk.rewards.push(reward);
    chunk.obs.push(Float32Array.from(nextObs));
  }

  /** The episode of `env` ended: its chunk is complete; the next starts from `firstObs`. */
  end(env, terminated, truncated, firstObs) {
    this.done.push({ ...this.open[env], terminated, truncated });
    this.start(env, firstObs);
  }

  /** Every chunk of this message as columns; running episodes continue from their last obs. */
  take(seq) {
    const chunks = this.done;
    this.done = [];
    this.open.forEach((chunk, env) => {
      if (chunk.actions.length === 0) return;             // nothing stepped since it started
      chunks.push({ ...chunk, terminated: false, truncated: false });
      this.open[env] = { id: chunk.id, obs: [chunk.obs[chunk.obs.length - 1]], actions: [], rewards: [], dist: [], logp: [] };
    });
    const steps = chunks.reduce((n, c) => n + c.actions.length, 0);
    const n = chunks.length;
    const obs = new Float32Array((steps + n) * this.obsSize);
    const dist = new Float32Array(steps * this.distWidth);
    const discrete = typeof chunks[0]?.actions[0] === 'number';
    const actionSize = discrete || n === 0 ? 1 : chunks[0].actions[0].length;
    const actions = discrete ? new BigInt64Array(steps) : new Float32Array(steps * actionSize);
    const [rewards, logp] = [new Float32Array(steps), new Float32Array(steps)];
    let row = 0;
    let step = 0;
    for (const c of chunks) {
      c.obs.forEach((o) => { obs.set(o, row * this.obsSize); row++; });
      c.actions.forEach((a, i) => {
        if (discrete) actions[step] = BigInt(a); else actions.set(a, step * actionSize);
        dist.set(c.dist[i], step * this.distWidth);
        rewards[step] = c.rewards[i];
        logp[step] = c.logp[i];
        step++;
      });
    }
    const columns = {
      lengths: new NdArray('<i8', [n], BigInt64Array.from(chunks, (c) => BigInt(c.actions.length))),
      obs: new NdArray('<f4', [steps + n, this.obsSize], obs),
      actions: new NdArray(discrete ? '<i8' : '<f4', discrete ? [steps] : [steps, actionSize], actions),
      rewards: new NdArray('<f4', [steps], rewards),
      action_dist_inputs: new NdArray('<f4', [steps, this.distWidth], dist),
      action_logp: new NdArray('<f4', [steps], logp),
      is_terminated: new NdArray('|b1', [n], Uint8Array.from(chunks, (c) => (c.terminated ? 1 : 0))),
      is_truncated: new NdArray('|b1', [n], Uint8Array.from(chunks, (c) => (c.truncated ? 1 : 0))),
      weights_seq_no: new NdArray('<i8', [n], BigInt64Array.from(chunks, () => BigInt(seq))),
      episode_id: chunks.map((c) => c.id),
    };
    return { episodes: new Columns(columns), steps };
  }
}

// ------------------------------------------------------------------ the client loop

/** One connection's life: handshake, then sample and send until the connection ends.
 * `makeEnvs(k)` gives K envs with reset() -> obs and step(action) -> [obs, reward,
 * terminated, truncated]; `space` = {obsSize, action: {type: 'Discrete', n} | {type: 'Box',
 * shape, low, high}}. `onConnected` is called once the handshake is done. */
async function runSession(ort, opts, onConnected) {
  const conn = await Connection.open(opts.host, opts.port);
  try {
    const { config, state } = await handshake(conn, opts);
    onConnected();
    if (opts.inference === 'server') return await serverInference(conn, opts, config);
    let policy = await Policy.load(ort, state);
    const { k, space } = opts;
    // A Box's bounds: the env's, or SET_CONFIG's where the env gave none; how to sample it:
    // SET_STATE's action_dist, else SET_CONFIG's (section 4.2; absent: RLlib's Gaussian).
    const boundsFromConfig = space.action.type === 'Box' && !space.action.low && config.action_space;
    const action = boundsFromConfig ? { ...space.action, low: config.action_space.low, high: config.action_space.high } : space.action;
    const sampler = new Sampler(action, opts.random, state.action_dist || config.action_dist);
    const setDist = (dist) => {
      const before = sampler.dist;
      sampler.setDist(dist);
      if (sampler.dist !== before) opts.log(`sampling actions as ${sampler.dist} (the learner's action_dist)`);
    };
    if (sampler.dist !== 'gaussian') opts.log(`sampling actions as ${sampler.dist} (the learner's action_dist)`);
    let stepsPerEnv = Math.ceil(config.env_steps_per_sample / k);
    const envs = opts.makeEnvs(k);
    const recorder = new Recorder(k, space.obsSize, sampler.width, `${opts.clientName || 'js'}-${opts.sessions++}`);
    const obs = new Float32Array(k * space.obsSize);
    envs.forEach((env, i) => { const o = env.reset(); obs.set(o, i * space.obsSize); recorder.start(i, o); });
    const returns = new Array(k).fill(0);
    let stepped = 0;
    for (;;) {
      for (let t = 0; t < stepsPerEnv; t++) {
        const dist = await policy.distInputs(obs, k);
        for (let i = 0; i < k; i++) {
          const [action, logp] = sampler.sample(dist, i * sampler.width);
          const [next, reward, terminated, truncated] = envs[i].step(action);
          recorder.record(i, action, dist.subarray(i * sampler.width, (i + 1) * sampler.width), logp, reward, next);
          returns[i] += reward;
          if (terminated || truncated) {
            const first = envs[i].reset();
            recorder.end(i, terminated, truncated, first);
            opts.onEpisode(returns[i]);
            returns[i] = 0;
            obs.set(first, i * space.obsSize);
          } else {
            obs.set(next, i * space.obsSize);
          }
        }
        stepped += k;
        conn.heartbeat(stepped);              // a hung env falls silent (section 5)
      }
      const { episodes, steps } = recorder.take(policy.version);
      const reply = await conn.request({ type: 'EPISODES_AND_GET_STATE', episodes, timesteps: steps },
        'SET_STATE', opts.timeoutS);    // strict on-policy: held until the next update (section 6)
      if (reply.weights_seq_no !== policy.version) policy = await Policy.load(ort, reply);
      setDist(reply.action_dist || config.action_dist);   // SAC: uniform in its warm-up, then squashed
      // The learner shares its train batch over the clients connected (RLLINK.md section 3.3).
      if (reply.env_steps_per_sample !== undefined) stepsPerEnv = Math.ceil(reply.env_steps_per_sample / k);
    }
  } finally {
    conn.close();
  }
}

/** K actions from an ACTIONS reply (binary: an NdArray, JSON: a list): ints for a
 * Discrete, Box rows clipped to the env's bounds (the server sends unclipped samples). */
function actionsOf(reply, k, action) {
  const a = reply.actions;
  const flat = a instanceof NdArray ? Array.from(a.data, Number) : a.flat();
  const d = action.type === 'Discrete' ? 1 : action.shape[0];
  if (flat.length !== k * d) throw new ProtocolError(`ACTIONS holds ${flat.length} values, expected ${k} x ${d}`);
  if (action.type === 'Discrete') return flat;
  return Array.from({ length: k }, (_, i) => flat.slice(i * d, (i + 1) * d)
    .map((v, j) => Math.min(Math.max(v, action.low[j]), action.high[j])));
}

/** Server-side inference (RLLINK.md section 11): each ACT carries the K envs' observations
 * and the outcome of their last step (none in the first), each ACTIONS the next actions;
 * the server keeps the trajectories. An env whose episode ended is reset at once: its obs
 * row is the new episode's first, its final_obs row the old one's last. */
async function serverInference(conn, opts, config) {
  const { k, space } = opts;
  const size = space.obsSize;
  if (config.observation_shape && (config.observation_shape.length !== 1 || config.observation_shape[0] !== size)) {
    throw new ProtocolError(`the server trains observations of shape [${config.observation_shape}], this env's are [${size}]`);
  }
  const envs = opts.makeEnvs(k);
  const obs = new Float32Array(k * size);
  envs.forEach((env, i) => obs.set(env.reset(), i * size));
  const returns = new Array(k).fill(0);
  let msg = { type: 'ACT', obs: new NdArray('<f4', [k, size], obs) };
  for (;;) {
    const actions = actionsOf(await conn.request(msg, 'ACTIONS', opts.timeoutS), k, space.action);
    const rewards = new Float32Array(k);
    const [terminateds, truncateds] = [new Uint8Array(k), new Uint8Array(k)];
    const finalObs = new Float32Array(k * size);
    for (let i = 0; i < k; i++) {
      const [next, reward, terminated, truncated] = envs[i].step(actions[i]);
      rewards[i] = reward;
      returns[i] += reward;
      if (terminated || truncated) {
        [terminateds[i], truncateds[i]] = [terminated ? 1 : 0, truncated ? 1 : 0];
        finalObs.set(next, i * size);
        opts.onEpisode(returns[i]);
        returns[i] = 0;
        obs.set(envs[i].reset(), i * size);
      } else {
        obs.set(next, i * size);
      }
    }
    msg = {
      type: 'ACT', obs: new NdArray('<f4', [k, size], obs), rewards: new NdArray('<f4', [k], rewards),
      terminateds: new NdArray('|b1', [k], terminateds), truncateds: new NdArray('|b1', [k], truncateds),
    };
    if (truncateds.includes(1)) msg.final_obs = new NdArray('<f4', [k, size], finalObs);
  }
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** Sessions until the server is gone: a lost connection is retried after 0.1 s, doubling up
 * to 2 s. Returns 0 when the server stays unreachable for `giveUpS` after a session (the run
 * is over), 1 when no connection was ever made; a protocol error is thrown. */
async function runClient(ort, opts) {
  const options = { codec: 'binary', timeoutS: REPLY_TIMEOUT_S, giveUpS: GIVE_UP_S, sessions: 0, host: '127.0.0.1', ...opts };
  options.random = options.random || seededRandom(options.seed || 0);
  options.onEpisode = options.onEpisode || (() => {});
  const log = options.log = options.log || ((line) => process.stderr.write(`${line}\n`));
  let connectedOnce = false;
  let lostAt = Date.now();
  let backoffMs = 100;
  for (;;) {
    try {
      await runSession(ort, options, () => { connectedOnce = true; backoffMs = 100; });
    } catch (e) {
      if (!(e instanceof ConnectionClosed)) throw e;
      if (connectedOnce && backoffMs === 100) lostAt = Date.now();
      if (Date.now() - lostAt > options.giveUpS * 1000) {
        log(connectedOnce ? `the server ended the session (${e.message})` : `cannot connect: ${e.message}`);
        return connectedOnce ? 0 : 1;
      }
      await sleep(backoffMs);
      backoffMs = Math.min(backoffMs * 2, 2000);
    }
  }
}

module.exports = {
  ACTION_DISTS, Connection, ConnectionClosed, ProtocolError, NdArray, Columns, Policy, Sampler, Recorder,
  encodeJson, encodeBinary, decodeBody, handshake, runSession, runClient, seededRandom, REPLY_TIMEOUT_S, GIVE_UP_S,
};
