#!/usr/bin/env node
'use strict';
/**
 * CartPole-v1 in JavaScript (gymnasium's physics), trained through shmrl_client.js:
 *
 *   python -m shmrl.run --sims 0 --tcp-port 5556 --env-steps-per-sample 256 &
 *   node clients/js/cartpole.js --port 5556 --envs 4
 *   node clients/js/cartpole.js --port 5556 --envs 4 --server-inference   # the server runs the policy
 *
 * Exit status: 0 when the server ended the session (it stayed away after closing the
 * connection), 1 when it could not be reached at all or broke the protocol, 2 for a bad
 * command line.
 */
const { runClient, REPLY_TIMEOUT_S, GIVE_UP_S } = require('./shmrl_client');

/** gymnasium's CartPole-v1: the same constants, Euler integration, float32 observations,
 * reward 1 per step, terminated past 2.4 m or 12 degrees, truncated at 500 steps. */
class CartPole {
  constructor(random) {
    this.random = random;
  }

  reset() {
    this.state = Array.from({ length: 4 }, () => this.random() * 0.1 - 0.05);
    this.steps = 0;
    return Float32Array.from(this.state);
  }

  step(action) {
    const [x, xDot, theta, thetaDot] = this.state;
    const force = action === 1 ? 10.0 : -10.0;
    const cos = Math.cos(theta);
    const sin = Math.sin(theta);
    const totalMass = 1.1;                                  // cart 1.0 + pole 0.1
    const poleMassLength = 0.05;                            // pole 0.1 * half-length 0.5
    const temp = (force + poleMassLength * thetaDot * thetaDot * sin) / totalMass;
    const thetaAcc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - (0.1 * cos * cos) / totalMass));
    const xAcc = temp - (poleMassLength * thetaAcc * cos) / totalMass;
    this.state = [x + 0.02 * xDot, xDot + 0.02 * xAcc, theta + 0.02 * thetaDot, thetaDot + 0.02 * thetaAcc];
    this.steps += 1;
    const terminated = Math.abs(this.state[0]) > 2.4 || Math.abs(this.state[2]) > (12 * 2 * Math.PI) / 360;
    return [Float32Array.from(this.state), 1.0, terminated, !terminated && this.steps >= 500];
  }
}

const SPACE = { obsSize: 4, action: { type: 'Discrete', n: 2 } };

function parseArgs(argv, prog = 'cartpole.js') {
  const args = { host: '127.0.0.1', port: null, envs: 4, seed: 0, codec: 'binary', name: null,
    authToken: process.env.SHMRL_AUTH_TOKEN || null, timeout: REPLY_TIMEOUT_S, giveUp: GIVE_UP_S, quiet: false, serverInference: false };
  const flags = { '--host': 'host', '--port': 'port', '--envs': 'envs', '--seed': 'seed', '--codec': 'codec',
    '--name': 'name', '--auth-token': 'authToken', '--timeout': 'timeout', '--give-up-s': 'giveUp' };
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--quiet') { args.quiet = true; continue; }
    if (argv[i] === '--server-inference') { args.serverInference = true; continue; }
    if (argv[i] === '--help' || argv[i] === '-h') {
      process.stdout.write(`usage: node ${prog} --port PORT [--host HOST] [--envs K] [--seed S] [--codec binary|json]\n`
        + `       [--name NAME] [--auth-token SECRET] [--timeout S] [--give-up-s S] [--server-inference] [--quiet]\n`);
      process.exit(0);
    }
    const key = flags[argv[i]];
    if (!key || i + 1 >= argv.length) throw new Error(`unknown or incomplete argument ${argv[i]}`);
    args[key] = argv[++i];
  }
  for (const key of ['port', 'envs', 'seed', 'timeout', 'giveUp']) args[key] = Number(args[key]);
  if (!Number.isInteger(args.port) || args.port < 1 || args.port > 65535) throw new Error('--port PORT (1-65535) is required');
  if (!Number.isInteger(args.envs) || args.envs < 1) throw new Error('--envs must be an integer >= 1');
  if (!['binary', 'json'].includes(args.codec)) throw new Error('--codec must be binary or json');
  if (!(args.timeout > 0) || !(args.giveUp >= 0)) throw new Error('--timeout must be > 0 and --give-up-s >= 0');
  return args;
}

/** The command line of an env's client (cartpole.js, pendulum.js): `Env` (constructed with
 * the seeded random) played in K copies, its spaces `space`. Returns the exit status. */
async function main(Env = CartPole, space = SPACE, prog = 'cartpole.js') {
  let args;
  try {
    args = parseArgs(process.argv.slice(2), prog);
  } catch (e) {
    process.stderr.write(`error: ${e.message}\n`);
    return 2;
  }
  // After the command line (--help needs no install); server-side inference needs no onnxruntime.
  const ort = args.serverInference ? null : require('onnxruntime-node');
  const { seededRandom } = require('./shmrl_client');
  const random = seededRandom(args.seed * 1000003 + 1);
  const recent = [];
  let lastLog = Date.now();
  const log = (line) => { if (!args.quiet) process.stderr.write(`${line}\n`); };
  return runClient(ort, {
    host: args.host, port: args.port, k: args.envs, space, codec: args.codec,
    clientName: args.name, authToken: args.authToken, timeoutS: args.timeout, giveUpS: args.giveUp,
    inference: args.serverInference ? 'server' : 'client',
    random, log,
    makeEnvs: (k) => Array.from({ length: k }, () => new Env(random)),
    onEpisode: (ret) => {
      recent.push(ret);
      if (recent.length > 100) recent.shift();
      if (Date.now() - lastLog > 5000) {
        lastLog = Date.now();
        log(`mean return of the last ${recent.length} episodes: ${(recent.reduce((a, b) => a + b, 0) / recent.length).toFixed(1)}`);
      }
    },
  });
}

/** Run `main` as the process's command line: its exit status, 1 on an error. */
function cli(...how) {
  main(...how).then((code) => process.exit(code), (e) => {
    process.stderr.write(`error: ${e.message}\n`);
    process.exit(1);
  });
}

if (require.main === module) cli();

module.exports = { CartPole, SPACE, main, cli };
