#!/usr/bin/env node
'use strict';
/**
 * Pendulum-v1 in JavaScript (gymnasium's physics): a Box action, for SAC (RLLINK.md section
 * 4.2: the client samples the squashed Gaussian and the uniform warm-up SET_STATE names):
 *
 *   python -m shmrl.run --env gym:Pendulum-v1 --algo sac --sims 0 --tcp-port 5556 &
 *   node clients/js/pendulum.js --port 5556 --envs 4
 *
 * The command line and exit status are cartpole.js's.
 */
const { cli } = require('./cartpole');

const MAX_SPEED = 8;
const MAX_TORQUE = 2;
const DT = 0.05;
const G = 10;

const angleNormalize = (x) => ((((x + Math.PI) % (2 * Math.PI)) + 2 * Math.PI) % (2 * Math.PI)) - Math.PI;

/** gymnasium's Pendulum-v1 (g = 10): torque clipped to [-2, 2], observation [cos th, sin th,
 * th dot], reward -(th^2 + 0.1 th_dot^2 + 0.001 u^2), never terminated, truncated at 200 steps. */
class Pendulum {
  constructor(random) {
    this.random = random;
  }

  reset() {
    this.th = this.random() * 2 * Math.PI - Math.PI;
    this.thDot = this.random() * 2 - 1;
    this.steps = 0;
    return this.observe();
  }

  observe() {
    return Float32Array.of(Math.cos(this.th), Math.sin(this.th), this.thDot);
  }

  step(action) {
    const u = Math.min(Math.max(action[0], -MAX_TORQUE), MAX_TORQUE);
    const cost = angleNormalize(this.th) ** 2 + 0.1 * this.thDot ** 2 + 0.001 * u ** 2;
    const thDot = Math.min(Math.max(this.thDot + (3 * G / 2 * Math.sin(this.th) + 3 * u) * DT, -MAX_SPEED), MAX_SPEED);
    this.th += thDot * DT;
    this.thDot = thDot;
    this.steps += 1;
    return [this.observe(), -cost, false, this.steps >= 200];
  }
}

const SPACE = { obsSize: 3, action: { type: 'Box', shape: [1], low: [-MAX_TORQUE], high: [MAX_TORQUE] } };

if (require.main === module) cli(Pendulum, SPACE, 'pendulum.js');

module.exports = { Pendulum, SPACE };
