// CartPole.cs: K CartPole-v1 envs in C#, trained by a shmrl server that chooses their actions
// through ShmrlClient.cs (server-side inference).
//
//     make -C clients/csharp && mono clients/csharp/build/cartpole.exe --port 5556 --envs 16
//
// The physics are gymnasium's CartPole-v1 exactly (clients/c/cartpole_env.h's port: the same
// constants, Euler integration, termination at |x| > 2.4 or |theta| > 12 degrees, truncation
// at 500 steps, reset uniform in [-0.05, 0.05]); tests/test_csharp_client.py steps gymnasium
// beside them. Exit status: 0 when the server ended the session (it closed the connection and
// stayed away for --give-up-s), 1 when there never was a session or it failed (the reason on
// stderr), 2 for bad arguments.
using System;
using System.Globalization;
using Shmrl;

static class CartPole
{
    const double Gravity = 9.8, MassCart = 1.0, MassPole = 0.1, TotalMass = MassPole + MassCart;
    const double Length = 0.5, PoleMassLength = MassPole * Length, ForceMag = 10.0, Tau = 0.02;   // half the pole's length
    const double ThetaThreshold = 12 * 2 * Math.PI / 360, XThreshold = 2.4;
    const int MaxEpisodeSteps = 500;

    /// <summary>One Euler step of s = x, x_dot, theta, theta_dot (float64, as gymnasium keeps it); returns terminated.</summary>
    static bool Physics(double[] s, int action)
    {
        double force = action == 1 ? ForceMag : -ForceMag;
        double costheta = Math.Cos(s[2]), sintheta = Math.Sin(s[2]);
        double temp = (force + PoleMassLength * (s[3] * s[3]) * sintheta) / TotalMass;
        double thetaacc = (Gravity * sintheta - costheta * temp) / (Length * (4.0 / 3.0 - MassPole * (costheta * costheta) / TotalMass));
        double xacc = temp - PoleMassLength * thetaacc * costheta / TotalMass;
        s[0] = s[0] + Tau * s[1];
        s[1] = s[1] + Tau * xacc;
        s[2] = s[2] + Tau * s[3];
        s[3] = s[3] + Tau * thetaacc;
        return s[0] < -XThreshold || s[0] > XThreshold || s[2] < -ThetaThreshold || s[2] > ThetaThreshold;
    }

    static ulong rng;
    static ulong Next()   // splitmix64
    {
        ulong z = rng += 0x9E3779B97F4A7C15UL;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9UL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBUL;
        return z ^ (z >> 31);
    }

    sealed class Env { public double[] S = new double[4]; public int Steps; public double Return; }

    static void Reset(Env env, float[] obs, int row)
    {
        for (int i = 0; i < 4; i++)
        {
            env.S[i] = -0.05 + 0.1 * ((Next() >> 11) / 9007199254740992.0);
            obs[row * 4 + i] = (float)env.S[i];
        }
        env.Steps = 0;
        env.Return = 0;
    }

    /// <summary>Lines "x x_dot theta theta_dot action" in, "x x_dot theta theta_dot terminated" out: the test of the physics.</summary>
    static int PhysicsCheck()
    {
        string line;
        var s = new double[4];
        while ((line = Console.In.ReadLine()) != null)
        {
            string[] f = line.Split(new[] { ' ' }, StringSplitOptions.RemoveEmptyEntries);
            if (f.Length != 5) break;
            for (int i = 0; i < 4; i++) s[i] = double.Parse(f[i], CultureInfo.InvariantCulture);
            bool terminated = Physics(s, int.Parse(f[4], CultureInfo.InvariantCulture));
            Console.WriteLine(string.Join(" ", Array.ConvertAll(s, v => v.ToString("R", CultureInfo.InvariantCulture))) + (terminated ? " 1" : " 0"));
        }
        return 0;
    }

    static int Usage(string why)
    {
        if (why != null) Console.Error.WriteLine("cartpole: " + why);
        Console.Error.WriteLine("usage: mono cartpole.exe [--host H] [--port P] [--envs K] [--seed S] [--name NAME] [--token SECRET]\n" +
                                "                         [--codec binary|json] [--reply-timeout S] [--give-up-s S] [--steps N] [--quiet]\n" +
                                "                         [--physics-check]\n" +
                                "  --envs K        CartPole envs stepped together, one ACT for all (default 1)\n" +
                                "  --give-up-s S   how long a server may stay away after a session before the client ends (5)\n" +
                                "  --steps N       stop after N env steps (default: until the server ends the session)");
        return why == null ? 0 : 2;
    }

    static int Main(string[] argv)
    {
        var opt = new ShmrlOptions { ObservationShape = new[] { 4 }, ActionSpace = ActionSpace.Discrete(2) };
        bool quiet = false;
        long maxSteps = 0;
        rng = (ulong)Environment.TickCount * 1000003UL ^ (ulong)System.Diagnostics.Process.GetCurrentProcess().Id;
        for (int i = 0; i < argv.Length; i++)
        {
            string key = argv[i], v = i + 1 < argv.Length ? argv[i + 1] : null;
            if (key == "--quiet") { quiet = true; continue; }
            if (key == "--physics-check") return PhysicsCheck();
            if (key == "--help" || key == "-h") return Usage(null);
            if (v == null) return Usage(key + " needs a value");
            i++;
            try
            {
                if (key == "--host") opt.Host = v;
                else if (key == "--port") opt.Port = int.Parse(v, CultureInfo.InvariantCulture);
                else if (key == "--envs") opt.Envs = int.Parse(v, CultureInfo.InvariantCulture);
                else if (key == "--seed") rng = ulong.Parse(v, CultureInfo.InvariantCulture);
                else if (key == "--name") opt.ClientName = v;
                else if (key == "--token") opt.AuthToken = v;
                else if (key == "--reply-timeout") opt.ReplyTimeoutS = double.Parse(v, CultureInfo.InvariantCulture);
                else if (key == "--give-up-s") opt.GiveUpS = double.Parse(v, CultureInfo.InvariantCulture);
                else if (key == "--steps") maxSteps = long.Parse(v, CultureInfo.InvariantCulture);
                else if (key == "--codec" && (v == "binary" || v == "json")) opt.Binary = v == "binary";
                else return Usage("unknown option or value: " + key + " " + v);
            }
            catch (FormatException) { return Usage("not a number: " + key + " " + v); }
            catch (OverflowException) { return Usage("out of range: " + key + " " + v); }
        }
        if (opt.Envs < 1 || opt.Envs > ShmrlClient.MaxEnvs) return Usage("--envs must be 1.." + ShmrlClient.MaxEnvs);
        return Play(opt, quiet, maxSteps);
    }

    /// <summary>ACT, step, repeat, until the server ends the session; the client reconnects by itself.</summary>
    static int Play(ShmrlOptions opt, bool quiet, long maxSteps)
    {
        int k = opt.Envs;
        string name = opt.ClientName ?? "client";
        var envs = new Env[k];
        float[] obs = new float[4 * k], finalObs = new float[4 * k], rewards = new float[k];
        bool[] terminateds = new bool[k], truncateds = new bool[k];
        var returns = new double[100];
        long envSteps = 0, episodes = 0;
        for (int e = 0; e < k; e++) Reset(envs[e] = new Env(), obs, e);
        var watch = System.Diagnostics.Stopwatch.StartNew();
        string why = "steps done";
        using (var client = new ShmrlClient(opt))
        {
            if (!quiet) client.Log = line => Console.Error.WriteLine("cartpole " + name + ": " + line);
            bool first = true;
            for (;;)
            {
                ShmrlActions actions;
                try
                {
                    if (!client.Act(obs, first ? null : rewards, first ? null : terminateds, first ? null : truncateds, first ? null : finalObs, out actions))
                    {
                        why = client.Error;   // the server ended the session
                        break;
                    }
                }
                catch (ShmrlException e)
                {
                    Console.Error.WriteLine("cartpole " + name + ": " + e.Message);
                    return 1;
                }
                first = false;
                for (int e = 0; e < k; e++)
                {
                    Env env = envs[e];
                    bool terminated = Physics(env.S, actions.Ints[e]);
                    bool truncated = ++env.Steps >= MaxEpisodeSteps;   // gymnasium's TimeLimit
                    rewards[e] = 1f;
                    terminateds[e] = terminated;
                    truncateds[e] = truncated;
                    env.Return += 1;
                    for (int j = 0; j < 4; j++) obs[e * 4 + j] = (float)env.S[j];
                    if (terminated || truncated)
                    {
                        Array.Copy(obs, e * 4, finalObs, e * 4, 4);
                        returns[episodes++ % 100] = env.Return;
                        Reset(env, obs, e);
                    }
                }
                envSteps += k;
                if (maxSteps > 0 && envSteps >= maxSteps) break;
            }
        }
        int n = (int)Math.Min(episodes, 100);
        double mean = 0;
        for (int i = 0; i < n; i++) mean += returns[i];
        Console.WriteLine(string.Format(CultureInfo.InvariantCulture, "cartpole {0}: {1}: {2} env steps, {3} episodes, mean return of the last {4}: {5:0.0}, in {6:0.00} s",
                                        name, why, envSteps, episodes, n, n > 0 ? mean / n : 0, watch.Elapsed.TotalSeconds));
        return 0;
    }
}
