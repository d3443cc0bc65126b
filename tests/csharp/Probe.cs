// A test program for tests/test_csharp_client.py, built with clients/csharp/ShmrlClient.cs.
//   mono probe.exe PORT poll            the non-blocking API: SubmitStep, TryGetActions each millisecond
//                                       while the server holds the reply, then polling without steps
//                                       (heartbeats go out), then not polling (they stop)
//   mono probe.exe PORT box|start CODEC Act() with a Box action of 2 dimensions, or a Discrete(3) from 1
using System;
using System.Diagnostics;
using System.Globalization;
using System.Threading;
using Shmrl;

static class Probe
{
    static string F(double v) { return v.ToString("0.###", CultureInfo.InvariantCulture); }

    static int Main(string[] argv)
    {
        string mode = argv[1];
        var opt = new ShmrlOptions { Port = int.Parse(argv[0]), Envs = 2, ObservationShape = new[] { 4 }, GiveUpS = 0.5,
                                     Binary = argv.Length < 3 || argv[2] == "binary" };
        opt.ActionSpace = mode == "box" ? ActionSpace.Box(new[] { -1f, -2f }, new[] { 1f, 2f })
                        : mode == "start" ? ActionSpace.Discrete(3, 1) : ActionSpace.Discrete(2);
        var obs = new float[] { 0.5f, 0, 0.25f, 0, 0, 0.5f, -0.25f, 0 };
        ShmrlActions a;
        using (var c = new ShmrlClient(opt))
        {
            if (mode == "poll")
            {
                var watch = Stopwatch.StartNew();
                c.SubmitStep(obs, null, null, null, null);
                Console.WriteLine("submit_ms " + F(watch.Elapsed.TotalMilliseconds));
                double worst = 0;
                long polls = 0;
                for (;;)
                {
                    double t0 = watch.Elapsed.TotalMilliseconds;
                    bool got = c.TryGetActions(out a);
                    worst = Math.Max(worst, watch.Elapsed.TotalMilliseconds - t0);
                    polls++;
                    if (got) break;
                    if (c.State != ShmrlState.Running) { Console.WriteLine("ended " + c.Error); return 1; }
                    Thread.Sleep(1);
                }
                Console.WriteLine("polls " + polls + " worst_ms " + F(worst) + " waited_ms " + F(watch.Elapsed.TotalMilliseconds));
                Console.WriteLine("actions " + a.Ints[0] + " " + a.Ints[1] + " seq " + a.WeightsSeqNo + " first " + a.FirstOfConnection);
                for (var t = Stopwatch.StartNew(); t.Elapsed.TotalSeconds < 0.6; Thread.Sleep(10)) c.TryGetActions(out a);
                Console.WriteLine("polled");
                Thread.Sleep(1500);   // a hung main thread: no heartbeats
                Console.WriteLine("done");
                return 0;
            }
            var rewards = new float[] { 1, -1 };
            var flags = new bool[2];
            for (int i = 0; i < 2; i++)
            {
                if (!c.Act(obs, i == 0 ? null : rewards, i == 0 ? null : flags, i == 0 ? null : flags, null, out a))
                {
                    Console.WriteLine("ended " + c.Error);
                    return 1;
                }
                Console.WriteLine(mode == "box" ? "actions " + F(a.Floats[0]) + " " + F(a.Floats[1]) + " " + F(a.Floats[2]) + " " + F(a.Floats[3])
                                                : "actions " + a.Ints[0] + " " + a.Ints[1]);
            }
        }
        return 0;
    }
}
