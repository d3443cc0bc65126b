// ShmrlClient.cs: an RLlink client for shmrl in one C# file, for Unity and any .NET that
// takes .NET Standard 2.0 (no NuGet package, no System.Text.Json: the JSON is hand-written
// here). The server runs the policy (server-side inference); the game sends its K envs'
// observations and gets their actions. The protocol is docs/RLLINK.md (section numbers
// below are its); docs/CLIENTS.md, "C# (Unity)", shows it in a MonoBehaviour.
//
//   framing                 8 ASCII digits, then the body; a header that is not 8 digits or
//                           announces more than MaxReplyBytes is refused (section 1)
//   handshake               PING {codecs, client_name, auth_token, inference: "server"} -> PONG,
//                           which must echo the inference; GET_CONFIG declaring the spaces ->
//                           SET_CONFIG (sections 2, 3.1, 3.2, 11)
//   codecs                  JSON, or the binary codec once the PONG agreed on it (section 7)
//   ACT -> ACTIONS          K observations and the last step's outcome; Discrete (plus its
//                           start), MultiDiscrete and Box actions, a Box's clipped (section 11.1)
//   heartbeats              when the PONG gave heartbeat_s, while the game polls (section 5)
//   reconnecting            0.1 s doubling to 2 s; a server that stays away GiveUpS after a
//                           session has ended it (section 2; docs/CLIENTS.md step 10)
//   threads                 a background thread owns the socket: connect, send and receive never
//                           block the caller (SubmitStep / TryGetActions); Act() waits for you
using System;
using System.Collections.Generic;
using System.Globalization;
using System.Net;
using System.Net.Sockets;
using System.Text;
using System.Threading;

namespace Shmrl
{
    public enum ActionKind { Discrete, MultiDiscrete, Box }

    /// <summary>An action space as SET_CONFIG describes it (RLLINK.md 11).</summary>
    public sealed class ActionSpace
    {
        public ActionKind Kind;
        public int N, Start;       // Discrete: actions Start .. Start + N - 1
        public int[] Nvec;         // MultiDiscrete
        public float[] Low, High;  // Box (flat)

        public static ActionSpace Discrete(int n, int start = 0) { return new ActionSpace { Kind = ActionKind.Discrete, N = n, Start = start }; }
        public static ActionSpace MultiDiscrete(params int[] nvec) { return new ActionSpace { Kind = ActionKind.MultiDiscrete, Nvec = nvec }; }
        public static ActionSpace Box(float[] low, float[] high) { return new ActionSpace { Kind = ActionKind.Box, Low = low, High = high }; }

        /// <summary>Values per env: 1 for a Discrete, d for the others.</summary>
        public int Dim { get { return Kind == ActionKind.Discrete ? 1 : Kind == ActionKind.MultiDiscrete ? Nvec.Length : Low.Length; } }
    }

    public sealed class ShmrlOptions
    {
        public string Host = "127.0.0.1";
        public int Port = 5556;
        public int Envs = 1;                         // K, fixed for the client's life
        public string ClientName, AuthToken;         // shown in the server's log; --auth-token's secret
        public bool Binary = true;                   // offer the binary codec (JSON if the server declines)
        public int[] ObservationShape;               // declared in GET_CONFIG with ActionSpace (RLLINK.md 3.2)
        public ActionSpace ActionSpace;
        public double ReplyTimeoutS = ShmrlClient.REPLY_TIMEOUT_S;
        public double GiveUpS = ShmrlClient.GIVE_UP_S;
        public double ConnectTimeoutS = 5;
    }

    /// <summary>One ACTIONS: K actions, Discrete/MultiDiscrete in Ints, a Box's in Floats (clipped),
    /// row k at [k * Dim, (k + 1) * Dim).</summary>
    public sealed class ShmrlActions
    {
        public int[] Ints;
        public float[] Floats;
        public int Dim;
        public long WeightsSeqNo;
        public bool FirstOfConnection;   // answered a connection's first ACT (the server forgot earlier episodes)
    }

    public enum ShmrlState { Running, Ended, Failed }

    /// <summary>A broken rule of the protocol (ours or the server's), or what this client cannot do.</summary>
    public class ShmrlException : Exception { public ShmrlException(string m) : base(m) { } }
    sealed class ConnectionLost : Exception { public ConnectionLost(string m) : base(m) { } }
    sealed class Refused : Exception { public Refused(string m) : base(m) { } }   // retrying cannot help

    public sealed class ShmrlClient : IDisposable
    {
        // Every shmrl client's (REPLY_TIMEOUT_S and GIVE_UP_S in shmrl/config/faces.py;
        // tests/test_client_numbers.py holds this file to them):
        public const double REPLY_TIMEOUT_S = 600;   // a strict on-policy server holds a reply through an update
        public const double GIVE_UP_S = 5;           // how long a server may stay away after a session
        public const int MaxReplyBytes = 64 * 1024 * 1024;    // never trust a header (RLLINK.md 1): the server's own frame limit
        public const int MaxEnvs = 4096;
        const double BackoffS = 0.1, BackoffMaxS = 2;
        static readonly byte[] Magic = { 0x93, 0x52, 0x4c, 0x42 };   // 0x93 "RLB": a binary body

        readonly ShmrlOptions opt;
        readonly int k, obsSize;
        readonly object gate = new object();
        readonly Thread thread;
        // Under gate: the step waiting to go out, the actions waiting to be taken, the state.
        Step pending;
        ShmrlActions ready;
        volatile bool stopping;
        long polledTicks;          // the caller's last call (heartbeats only while it is alive)
        // The background thread's own:
        Socket sock;
        bool binary, fresh;
        double heartbeatS;
        long lastSentTicks, envSteps;
        readonly System.Diagnostics.Stopwatch clock = System.Diagnostics.Stopwatch.StartNew();

        public ShmrlState State { get; private set; }
        public string Error { get; private set; }        // why it ended or failed
        public int Sessions { get; private set; }        // handshakes done
        public long Acts { get; private set; }           // ACTIONS received
        public int[] ObservationShape { get; private set; }   // the server's, from SET_CONFIG
        public ActionSpace ActionSpace { get; private set; }
        public long EnvStepsPerSample { get; private set; }
        /// <summary>Called on the background thread for each note (reconnects); null: none.</summary>
        public Action<string> Log;

        sealed class Step { public float[] Obs, Rewards, FinalObs; public bool[] Terminateds, Truncateds; }

        public ShmrlClient(ShmrlOptions options)
        {
            opt = options;
            k = options.Envs;
            if (k < 1 || k > MaxEnvs) throw new ArgumentException("Envs must be 1.." + MaxEnvs);
            if (options.ObservationShape == null || options.ActionSpace == null)
                throw new ArgumentException("ObservationShape and ActionSpace are needed: the GET_CONFIG declares them");
            obsSize = 1;
            foreach (int d in options.ObservationShape) obsSize *= d;
            thread = new Thread(Run) { IsBackground = true, Name = "shmrl" };
            thread.Start();
        }

        /// <summary>Queue the next ACT: the K envs' observations (K * obs size floats) and the outcome of
        /// the last actions (null before the first; a connection's first ACT leaves it out by itself).
        /// finalObs: the last observation of each env whose episode ended (rows of envs not truncated
        /// are not used). Returns at once; the arrays are copied.</summary>
        public void SubmitStep(float[] obs, float[] rewards, bool[] terminateds, bool[] truncateds, float[] finalObs)
        {
            Step s = new Step { Obs = Copy(obs, k * obsSize, "obs"), Rewards = Copy(rewards, k, "rewards"),
                Terminateds = terminateds == null ? null : (bool[])terminateds.Clone(),
                Truncateds = truncateds == null ? null : (bool[])truncateds.Clone(), FinalObs = Copy(finalObs, k * obsSize, "finalObs") };
            if ((s.Terminateds != null && s.Terminateds.Length != k) || (s.Truncateds != null && s.Truncateds.Length != k))
                throw new ArgumentException("terminateds and truncateds hold one flag per env");
            bool anyTruncated = s.Truncateds != null && Array.IndexOf(s.Truncateds, true) >= 0;
            if (anyTruncated && s.FinalObs == null) throw new ArgumentException("an env was truncated: finalObs is needed");
            if ((s.Rewards == null) != (s.Terminateds == null) || (s.Rewards == null) != (s.Truncateds == null))
                throw new ArgumentException("rewards, terminateds and truncateds go together (all null before the first step)");
            lock (gate)
            {
                if (State != ShmrlState.Running) throw new InvalidOperationException("the session is over: " + Error);
                if (pending != null || ready != null) throw new InvalidOperationException("take the last actions (TryGetActions) before the next step");
                if (s.Rewards == null && Acts > 0) throw new ArgumentException("rewards, terminateds and truncateds are needed after the first step");
                pending = s;
                polledTicks = clock.ElapsedTicks;
                Monitor.PulseAll(gate);
            }
        }

        /// <summary>The actions of the step submitted, once they came; false until then (or after the end:
        /// see State). Never blocks: call it each frame.</summary>
        public bool TryGetActions(out ShmrlActions actions)
        {
            lock (gate)
            {
                polledTicks = clock.ElapsedTicks;
                actions = ready;
                ready = null;
                return actions != null;
            }
        }

        /// <summary>SubmitStep, then wait for its actions. False when the server ended the session
        /// (State Ended); a ShmrlException when the client failed (State Failed).</summary>
        public bool Act(float[] obs, float[] rewards, bool[] terminateds, bool[] truncateds, float[] finalObs, out ShmrlActions actions)
        {
            actions = null;
            lock (gate) { if (State == ShmrlState.Ended) return false; }
            SubmitStep(obs, rewards, terminateds, truncateds, finalObs);
            lock (gate)
            {
                while (ready == null && State == ShmrlState.Running)
                {
                    polledTicks = clock.ElapsedTicks;   // this thread is alive: heartbeats may go out
                    Monitor.Wait(gate, 50);
                }
                if (ready != null) { actions = ready; ready = null; return true; }
                if (State == ShmrlState.Failed) throw new ShmrlException(Error);
                return false;
            }
        }

        public void Dispose()
        {
            stopping = true;
            lock (gate) Monitor.PulseAll(gate);
            Socket s = sock;
            if (s != null) s.Close();
            thread.Join(2000);
        }

        static float[] Copy(float[] a, int n, string name)
        {
            if (a == null) return null;
            if (a.Length != n) throw new ArgumentException(name + " holds " + a.Length + " floats, expected " + n);
            for (int i = 0; i < n; i++)
                if (float.IsNaN(a[i]) || float.IsInfinity(a[i])) throw new ArgumentException(name + "[" + i + "] is not finite");
            return (float[])a.Clone();
        }

        double Seconds(long ticks) { return (double)ticks / System.Diagnostics.Stopwatch.Frequency; }
        double Now() { return Seconds(clock.ElapsedTicks); }
        void Note(string line) { Action<string> log = Log; if (log != null) log(line); }

        void Finish(ShmrlState state, string why)
        {
            lock (gate) { State = state; Error = why; Monitor.PulseAll(gate); }
        }

        // ---------------------------------------------------------------- the background thread

        /// <summary>Sessions until the server is gone (RLLINK.md 2): a lost connection is retried
        /// after 0.1 s, doubling to 2 s; once actions came, a server away for GiveUpS has ended the run.</summary>
        void Run()
        {
            double lostAt = Now(), backoff = BackoffS;
            bool served = false;
            string why = "";
            while (!stopping)
            {
                try
                {
                    Connect();
                    Handshake();
                    Serve(ref served, ref backoff);
                }
                catch (Refused e) { Disconnect(); Finish(ShmrlState.Failed, e.Message); return; }
                catch (ConnectionLost e) { why = e.Message; }
                catch (ShmrlException e) { why = e.Message; }   // the server broke the protocol: start again
                catch (SocketException e) { why = e.Message; }
                catch (ObjectDisposedException) { why = "closed"; }
                catch (Exception e) { Disconnect(); Finish(ShmrlState.Failed, "internal error: " + e); return; }
                Disconnect();
                if (stopping) break;
                if (backoff == BackoffS) lostAt = Now();   // the first failure since a session served
                if (Now() - lostAt > opt.GiveUpS)
                {
                    Finish(served ? ShmrlState.Ended : ShmrlState.Failed,
                           served ? "the server ended the session (" + why + ")" : "no session with " + opt.Host + ":" + opt.Port + ": " + why);
                    return;
                }
                Note("connection lost (" + why + "); reconnecting in " + backoff.ToString("0.0", CultureInfo.InvariantCulture) + " s");
                Thread.Sleep((int)(backoff * 1000));
                backoff = Math.Min(backoff * 2, BackoffMaxS);
            }
            Finish(ShmrlState.Ended, "stopped");
        }

        void Connect()
        {
            Socket s = new Socket(AddressFamily.InterNetwork, SocketType.Stream, ProtocolType.Tcp);
            sock = s;
            IPAddress addr;
            if (!IPAddress.TryParse(opt.Host, out addr))
            {
                addr = null;
                foreach (IPAddress a in Dns.GetHostAddresses(opt.Host)) if (a.AddressFamily == AddressFamily.InterNetwork) { addr = a; break; }
                if (addr == null) throw new ConnectionLost("no IPv4 address for " + opt.Host);
            }
            IAsyncResult ar = s.BeginConnect(new IPEndPoint(addr, opt.Port), null, null);
            if (!ar.AsyncWaitHandle.WaitOne(TimeSpan.FromSeconds(opt.ConnectTimeoutS)))
                throw new ConnectionLost("cannot connect to " + opt.Host + ":" + opt.Port + " in " + opt.ConnectTimeoutS + " s");
            s.EndConnect(ar);
            s.NoDelay = true;   // small frames, each waited for (RLLINK.md 1)
            binary = false;
            heartbeatS = 0;
        }

        void Disconnect()
        {
            Socket s = sock;
            sock = null;
            if (s == null) return;
            try { s.Shutdown(SocketShutdown.Both); } catch (Exception) { }
            s.Close();
        }

        /// <summary>PING -> PONG, GET_CONFIG -> SET_CONFIG (RLLINK.md 3, 11).</summary>
        void Handshake()
        {
            var ping = new StringBuilder("{\"type\": \"PING\"");
            if (!string.IsNullOrEmpty(opt.AuthToken)) ping.Append(", \"auth_token\": ").Append(Json.Quote(opt.AuthToken));
            if (opt.Binary) ping.Append(", \"codecs\": [\"binary\"]");
            if (!string.IsNullOrEmpty(opt.ClientName)) ping.Append(", \"client_name\": ").Append(Json.Quote(opt.ClientName));
            ping.Append(", \"inference\": \"server\"}");
            SendBody(Encoding.UTF8.GetBytes(ping.ToString()));
            Dictionary<string, object> pong = Expect("PONG");
            object codec;
            if (pong.TryGetValue("codec", out codec))
            {
                if (!"binary".Equals(codec) || !opt.Binary) throw new ShmrlException("PONG names codec " + codec + ", which was not offered");
                binary = true;
                object hb;
                heartbeatS = pong.TryGetValue("heartbeat_s", out hb) && hb is double && (double)hb > 0 ? (double)hb : 0;
            }
            object inference;
            if (!pong.TryGetValue("inference", out inference) || !"server".Equals(inference))
                throw new Refused("the server does not serve actions (its PONG did not grant \"inference\": \"server\"): " +
                                  "it is not shmrl, or too old, or a multi-agent run");
            SendBody(Encoding.UTF8.GetBytes("{\"type\": \"GET_CONFIG\"" + DeclaredSpaces() + "}"));
            ReadConfig(Expect("SET_CONFIG"));
            fresh = true;   // the next ACT is the connection's first: observations only
            envSteps = 0;   // a HEARTBEAT counts the steps of its connection
            Sessions++;
        }

        /// <summary>The GET_CONFIG fields that declare the spaces (RLLINK.md 3.2), as json.dumps writes them.</summary>
        string DeclaredSpaces()
        {
            ActionSpace a = opt.ActionSpace;
            var b = new StringBuilder(", \"observation_shape\": [");
            b.Append(string.Join(", ", Array.ConvertAll(opt.ObservationShape, d => d.ToString(CultureInfo.InvariantCulture))));
            b.Append("], \"observation_dtype\": \"<f4\", \"action_space\": ");
            if (a.Kind == ActionKind.Discrete)
                b.Append("{\"type\": \"Discrete\", \"n\": ").Append(a.N).Append(a.Start != 0 ? ", \"start\": " + a.Start : "");
            else if (a.Kind == ActionKind.MultiDiscrete)
                b.Append("{\"type\": \"MultiDiscrete\", \"nvec\": [").Append(string.Join(", ", Array.ConvertAll(a.Nvec, v => v.ToString(CultureInfo.InvariantCulture)))).Append("]");
            else
            {
                b.Append("{\"type\": \"Box\", \"shape\": [").Append(a.Low.Length).Append("], \"low\": ");
                Json.Floats(b, a.Low, 0, a.Low.Length);
                b.Append(", \"high\": ");
                Json.Floats(b, a.High, 0, a.High.Length);
            }
            return b.Append("}").ToString();
        }

        /// <summary>SET_CONFIG's spaces: they must be what this client declared (a learner with --env
        /// has its own); what this client cannot send is refused here, not in a later reply.</summary>
        void ReadConfig(Dictionary<string, object> config)
        {
            object v;
            if (config.ContainsKey("observation_leaves")) throw new Refused("this client sends one float array; the server's env has Dict or Tuple observations");
            if (config.TryGetValue("policy_map", out v) && v != null) throw new Refused("this client does not support multi-agent envs (SET_CONFIG policy_map)");
            if (config.TryGetValue("observation_dtype", out v) && !"<f4".Equals(v)) throw new Refused("observations of dtype " + v + " are not supported: float32 only");
            if (!config.TryGetValue("env_steps_per_sample", out v) || !Json.IsInt(v, 1, 2e9)) throw new ShmrlException("SET_CONFIG without an env_steps_per_sample of 1 to 2e9");
            EnvStepsPerSample = (long)(double)v;
            int[] shape = opt.ObservationShape;
            if (config.TryGetValue("observation_shape", out v))
            {
                shape = Json.Ints(v, "observation_shape", 1, 1 << 24);
                if (string.Join(",", Array.ConvertAll(shape, d => d.ToString())) != string.Join(",", Array.ConvertAll(opt.ObservationShape, d => d.ToString())))
                    throw new Refused("the server trains observations of shape [" + string.Join(", ", Array.ConvertAll(shape, d => d.ToString())) + "], this env's are [" +
                                      string.Join(", ", Array.ConvertAll(opt.ObservationShape, d => d.ToString())) + "]");
            }
            ObservationShape = shape;
            ActionSpace = config.TryGetValue("action_space", out v) ? ReadSpace(v) : opt.ActionSpace;
        }

        static ActionSpace ReadSpace(object v)
        {
            var space = v as Dictionary<string, object>;
            object t, n, start;
            if (space == null || !space.TryGetValue("type", out t)) throw new ShmrlException("SET_CONFIG: action_space is not an object with a type");
            if ("Discrete".Equals(t))
            {
                if (!space.TryGetValue("n", out n) || !Json.IsInt(n, 1, 1e9)) throw new ShmrlException("SET_CONFIG: a Discrete action_space without an n of 1 to 1e9");
                if (space.TryGetValue("start", out start) && !Json.IsInt(start, -1e9, 1e9)) throw new ShmrlException("SET_CONFIG: a Discrete start that is no int");
                return ActionSpace.Discrete((int)(double)n, start == null ? 0 : (int)(double)start);
            }
            if ("MultiDiscrete".Equals(t))
                return ActionSpace.MultiDiscrete(Json.Ints(space.TryGetValue("nvec", out n) ? n : null, "nvec", 1, 1e9));
            if ("Box".Equals(t))
            {
                object lo, hi;
                space.TryGetValue("low", out lo);
                space.TryGetValue("high", out hi);
                float[] low = Json.FloatList(lo), high = Json.FloatList(hi);
                if (low == null || high == null || low.Length != high.Length || low.Length == 0) throw new Refused("SET_CONFIG: a Box action_space needs flat low and high of equal lengths");
                return ActionSpace.Box(low, high);
            }
            throw new Refused("SET_CONFIG: an action_space this client does not know: " + t);
        }

        /// <summary>One connection: each step submitted goes out as an ACT, its ACTIONS comes back
        /// to the caller; heartbeats while the caller is alive but has nothing to send.</summary>
        void Serve(ref bool served, ref double backoff)
        {
            for (;;)
            {
                Step s;
                bool beat = false;
                lock (gate)
                {
                    while (pending == null && !stopping)
                    {
                        double idle = Now() - Seconds(lastSentTicks);
                        // A HEARTBEAT only while the caller polls: a game whose main thread hangs falls silent
                        // (RLLINK.md 5), within 4 heartbeat_s, before the server's hang timeout (5 heartbeat_s).
                        if (heartbeatS > 0 && idle >= heartbeatS && Now() - Seconds(polledTicks) < 3 * heartbeatS) { beat = true; break; }
                        double wait = heartbeatS <= 0 ? 1 : idle >= heartbeatS ? heartbeatS : heartbeatS - idle;
                        Monitor.Wait(gate, TimeSpan.FromSeconds(Math.Min(wait, 1)));
                    }
                    if (stopping) return;
                    s = pending;
                }
                if (beat) { SendBody(Heartbeat()); continue; }
                bool first = fresh;
                SendBody(binary ? ActBinary(s, first) : ActJson(s, first));
                fresh = false;
                envSteps += first ? 0 : k;
                Dictionary<string, object> reply = Expect("ACTIONS");
                ShmrlActions actions = ReadActions(reply, first);
                lock (gate)
                {
                    pending = null;
                    ready = actions;
                    Acts++;
                    Monitor.PulseAll(gate);
                }
                served = true;
                backoff = BackoffS;
            }
        }

        byte[] Heartbeat()
        {
            string text = binary ? "{\"type\":\"HEARTBEAT\",\"env_steps\":" + envSteps + "}" : "{\"type\": \"HEARTBEAT\", \"env_steps\": " + envSteps + "}";
            return binary ? BinaryBody(text, new List<byte[]>()) : Encoding.UTF8.GetBytes(text);
        }

        // ---------------------------------------------------------------- ACT and ACTIONS (RLLINK.md 11.1)

        /// <summary>final_obs rows: a truncated env's last observation; the others' current one (it fits the env).</summary>
        float[] FinalRows(Step s)
        {
            float[] rows = (float[])s.Obs.Clone();
            for (int e = 0; e < k; e++) if (s.Truncateds[e]) Array.Copy(s.FinalObs, e * obsSize, rows, e * obsSize, obsSize);
            return rows;
        }

        static bool Outcome(Step s, bool first) { return !first && s.Rewards != null; }
        static bool AnyTruncated(Step s) { return s.Truncateds != null && Array.IndexOf(s.Truncateds, true) >= 0; }

        byte[] ActJson(Step s, bool first)
        {
            var b = new StringBuilder("{\"type\": \"ACT\", \"obs\": ");
            ObsJson(b, s.Obs);
            if (Outcome(s, first))
            {
                b.Append(", \"rewards\": ");
                Json.Floats(b, s.Rewards, 0, k);
                b.Append(", \"terminateds\": ").Append(Json.Bools(s.Terminateds, k));
                b.Append(", \"truncateds\": ").Append(Json.Bools(s.Truncateds, k));
                if (AnyTruncated(s)) { b.Append(", \"final_obs\": "); ObsJson(b, FinalRows(s)); }
            }
            return Encoding.UTF8.GetBytes(b.Append("}").ToString());
        }

        /// <summary>K observations as nested lists of the observation's shape.</summary>
        void ObsJson(StringBuilder b, float[] obs)
        {
            int[] shape = new int[opt.ObservationShape.Length + 1];
            shape[0] = k;
            Array.Copy(opt.ObservationShape, 0, shape, 1, opt.ObservationShape.Length);
            int at = 0;
            Json.Nested(b, obs, shape, 0, ref at);
        }

        byte[] ActBinary(Step s, bool first)
        {
            var blocks = new List<byte[]>();
            var head = new StringBuilder("{\"type\":\"ACT\",\"obs\":");
            string obsShape = k + "," + string.Join(",", Array.ConvertAll(opt.ObservationShape, d => d.ToString(CultureInfo.InvariantCulture)));
            Block(head, blocks, "<f4", obsShape, Floats(s.Obs));
            if (Outcome(s, first))
            {
                head.Append(",\"rewards\":");
                Block(head, blocks, "<f4", k.ToString(), Floats(s.Rewards));
                head.Append(",\"terminateds\":");
                Block(head, blocks, "|b1", k.ToString(), BoolBytes(s.Terminateds));
                head.Append(",\"truncateds\":");
                Block(head, blocks, "|b1", k.ToString(), BoolBytes(s.Truncateds));
                if (AnyTruncated(s)) { head.Append(",\"final_obs\":"); Block(head, blocks, "<f4", obsShape, Floats(FinalRows(s))); }
            }
            return BinaryBody(head.Append("}").ToString(), blocks);
        }

        static int Align8(int n) { return (n + 7) / 8 * 8; }

        /// <summary>An array's descriptor into the head, its bytes (8-aligned) into the blocks (RLLINK.md 7).</summary>
        static void Block(StringBuilder head, List<byte[]> blocks, string dtype, string shape, byte[] data)
        {
            int offset = 0;
            foreach (byte[] x in blocks) offset += Align8(x.Length);
            head.Append("{\"__nd__\":[\"").Append(dtype).Append("\",[").Append(shape).Append("],").Append(offset).Append(',').Append(data.Length).Append("]}");
            blocks.Add(data);
        }

        static byte[] BinaryBody(string head, List<byte[]> blocks)
        {
            byte[] h = Encoding.UTF8.GetBytes(head);
            int size = Align8(8 + h.Length);
            foreach (byte[] x in blocks) size += Align8(x.Length);
            byte[] body = new byte[size];   // zeroed: the padding
            Array.Copy(Magic, body, 4);
            WriteU32(body, 4, (uint)h.Length);
            Array.Copy(h, 0, body, 8, h.Length);
            int at = Align8(8 + h.Length);
            foreach (byte[] x in blocks) { Array.Copy(x, 0, body, at, x.Length); at += Align8(x.Length); }
            return body;
        }

        static void WriteU32(byte[] b, int at, uint v) { for (int i = 0; i < 4; i++) b[at + i] = (byte)(v >> (8 * i)); }

        /// <summary>float32s as little-endian bytes, whatever the machine's order.</summary>
        static byte[] Floats(float[] a)
        {
            byte[] b = new byte[a.Length * 4];
            Buffer.BlockCopy(a, 0, b, 0, b.Length);
            if (!BitConverter.IsLittleEndian) for (int i = 0; i < b.Length; i += 4) Array.Reverse(b, i, 4);
            return b;
        }

        byte[] BoolBytes(bool[] a)
        {
            byte[] b = new byte[k];
            for (int i = 0; i < k; i++) b[i] = a != null && a[i] ? (byte)1 : (byte)0;
            return b;
        }

        /// <summary>K actions of an ACTIONS (binary: an array of the data section; JSON: a list):
        /// Discrete shifted by its start, a Box's clipped (the server sends unclipped samples).</summary>
        ShmrlActions ReadActions(Dictionary<string, object> reply, bool first)
        {
            ActionSpace space = ActionSpace;
            int dim = space.Dim;
            object v, seq;
            if (!reply.TryGetValue("weights_seq_no", out seq) || !Json.IsInt(seq, 0, 9e15)) throw new ShmrlException("ACTIONS without a weights_seq_no");
            if (!reply.TryGetValue("actions", out v)) throw new ShmrlException("ACTIONS without actions");
            double[] values = v is NdArray ? ((NdArray)v).Values(space.Kind == ActionKind.Box ? "<f4" : "<i8", k, dim)
                                           : Json.Flatten(v, k, space.Kind == ActionKind.Discrete ? 0 : dim);
            var a = new ShmrlActions { Dim = dim, WeightsSeqNo = (long)(double)seq, FirstOfConnection = first };
            if (space.Kind == ActionKind.Box)
            {
                a.Floats = new float[k * dim];
                for (int i = 0; i < a.Floats.Length; i++)
                {
                    double x = Math.Min(Math.Max(values[i], space.Low[i % dim]), space.High[i % dim]);
                    if (double.IsNaN(x) || double.IsInfinity(x)) throw new ShmrlException("ACTIONS: a Box action that is not finite");
                    a.Floats[i] = (float)x;
                }
                return a;
            }
            a.Ints = new int[k * dim];
            for (int i = 0; i < a.Ints.Length; i++)
            {
                int n = space.Kind == ActionKind.Discrete ? space.N : space.Nvec[i % dim];
                if (!(values[i] >= 0 && values[i] < n && values[i] == Math.Floor(values[i]))) throw new ShmrlException("ACTIONS: action " + values[i] + " is not in 0.." + (n - 1));
                a.Ints[i] = (int)values[i] + (space.Kind == ActionKind.Discrete ? space.Start : 0);
            }
            return a;
        }

        // ---------------------------------------------------------------- frames (RLLINK.md 1)

        void SendBody(byte[] body)
        {
            byte[] frame = new byte[8 + body.Length];
            Encoding.ASCII.GetBytes(body.Length.ToString("D8", CultureInfo.InvariantCulture), 0, 8, frame, 0);
            Array.Copy(body, 0, frame, 8, body.Length);
            Socket s = sock;
            if (s == null) throw new ConnectionLost("closed");
            for (int at = 0; at < frame.Length;) at += s.Send(frame, at, frame.Length - at, SocketFlags.None);
            lastSentTicks = clock.ElapsedTicks;
        }

        /// <summary>The next reply, which must be of type `type`, within the reply timeout.</summary>
        Dictionary<string, object> Expect(string type)
        {
            double deadline = Now() + opt.ReplyTimeoutS;
            byte[] header = Take(8, deadline);
            int length = 0;
            foreach (byte c in header)
            {
                if (c < (byte)'0' || c > (byte)'9') throw new ShmrlException("bad frame header \"" + Encoding.ASCII.GetString(header).Replace("\"", "\\\"") + "\"");
                length = length * 10 + (c - '0');   // 8 digits: at most 99,999,999, no overflow
            }
            if (length > MaxReplyBytes) throw new ShmrlException("a reply of " + length + " bytes is too large");
            Dictionary<string, object> msg = Decode(Take(length, deadline));
            object t;
            msg.TryGetValue("type", out t);
            if (!type.Equals(t)) throw new ShmrlException("expected " + type + ", got " + (t ?? "no type"));
            return msg;
        }

        byte[] Take(int n, double deadline)
        {
            byte[] buf = new byte[n];
            Socket s = sock;
            for (int got = 0; got < n;)
            {
                double left = deadline - Now();
                if (left <= 0 || s == null) throw new ConnectionLost("no reply within " + opt.ReplyTimeoutS.ToString(CultureInfo.InvariantCulture) + " s");
                // Wait in short slices: Dispose() and the deadline are noticed within 0.2 s.
                if (!s.Poll((int)(Math.Min(left, 0.2) * 1e6), SelectMode.SelectRead)) { if (stopping) throw new ConnectionLost("stopped"); continue; }
                int r = s.Receive(buf, got, n - got, SocketFlags.None);
                if (r == 0) throw new ConnectionLost("the server closed the connection");
                got += r;
            }
            return buf;
        }

        static Dictionary<string, object> Decode(byte[] body)
        {
            object msg;
            if (body.Length >= 4 && body[0] == Magic[0] && body[1] == Magic[1] && body[2] == Magic[2] && body[3] == Magic[3])
            {
                if (body.Length < 8) throw new ShmrlException("a binary body shorter than its preamble");
                uint headLen = (uint)(body[4] | body[5] << 8 | body[6] << 16 | body[7] << 24);
                if (headLen > body.Length - 8) throw new ShmrlException("a binary head overruns its body");
                int dataStart = Align8(8 + (int)headLen);
                msg = new Json(body, 8, 8 + (int)headLen, body, Math.Min(dataStart, body.Length)).Parse();
            }
            else msg = new Json(body, 0, body.Length, null, 0).Parse();
            var obj = msg as Dictionary<string, object>;
            if (obj == null) throw new ShmrlException("a reply that is not a JSON object");
            return obj;
        }
    }

    /// <summary>An array of a binary body's data section (RLLINK.md 7): {"__nd__": [dtype, shape, offset, nbytes]}.</summary>
    sealed class NdArray
    {
        public string Dtype;
        public int[] Shape;
        public byte[] Data;

        /// <summary>Its values, checked to be `dtype` of shape [k] or [k, dim] (a [k] only where dim is 1).</summary>
        public double[] Values(string dtype, int k, int dim)
        {
            if (Dtype != dtype) throw new ShmrlException("ACTIONS: actions of dtype " + Dtype + ", expected " + dtype);
            bool fits = Shape.Length == 2 ? Shape[0] == k && Shape[1] == dim : Shape.Length == 1 && Shape[0] == k && dim == 1;
            if (!fits) throw new ShmrlException("ACTIONS: actions of the wrong shape");
            int size = dtype == "<f4" ? 4 : 8;
            double[] v = new double[k * dim];
            for (int i = 0; i < v.Length; i++)
            {
                ulong u = 0;
                for (int j = size - 1; j >= 0; j--) u = u << 8 | Data[i * size + j];
                v[i] = size == 4 ? (double)BitConverter.ToSingle(BitConverter.GetBytes((uint)u), 0) : (double)(long)u;
            }
            return v;
        }
    }

    /// <summary>Just enough JSON: a reader of replies (objects, lists, strings, numbers as double,
    /// true/false/null; binary descriptors become NdArrays) and the writers the requests need.</summary>
    sealed class Json
    {
        const int MaxDepth = 64;
        readonly byte[] text, data;
        readonly int end, dataStart;
        int at, depth;

        public Json(byte[] text, int start, int end, byte[] data, int dataStart)
        {
            this.text = text; at = start; this.end = end; this.data = data; this.dataStart = dataStart;
        }

        public object Parse()
        {
            object v = Value();
            Space();
            if (at != end) Fail("text after the value");
            return v;
        }

        void Fail(string why) { throw new ShmrlException("a reply that is not valid JSON: " + why + " at byte " + at); }
        void Space() { while (at < end && (text[at] == ' ' || text[at] == '\t' || text[at] == '\n' || text[at] == '\r')) at++; }
        byte Peek() { if (at >= end) Fail("the end"); return text[at]; }

        object Value()
        {
            Space();
            byte c = Peek();
            if (c == '{' || c == '[')
            {
                if (++depth > MaxDepth) Fail("nesting deeper than " + MaxDepth);
                object v = c == '{' ? (object)Object() : List();
                depth--;
                return v;
            }
            if (c == '"') return String();
            if (Word("true")) return true;
            if (Word("false")) return false;
            if (Word("null")) return null;
            return Number();
        }

        bool Word(string w)
        {
            if (end - at < w.Length) return false;
            for (int i = 0; i < w.Length; i++) if (text[at + i] != w[i]) return false;
            at += w.Length;
            return true;
        }

        object Object()
        {
            var obj = new Dictionary<string, object>();
            at++;
            Space();
            if (Peek() == '}') { at++; return obj; }
            for (;;)
            {
                Space();
                if (Peek() != '"') Fail("a key that is not a string");
                string key = String();
                Space();
                if (Peek() != ':') Fail("no ':'");
                at++;
                obj[key] = Value();
                Space();
                byte c = Peek();
                at++;
                if (c == '}') break;
                if (c != ',') Fail("no ',' or '}'");
            }
            object nd;
            if (data != null && obj.TryGetValue("__nd__", out nd)) return NdArrayOf(nd);
            return obj;
        }

        List<object> List()
        {
            var list = new List<object>();
            at++;
            Space();
            if (Peek() == ']') { at++; return list; }
            for (;;)
            {
                list.Add(Value());
                Space();
                byte c = Peek();
                at++;
                if (c == ']') return list;
                if (c != ',') Fail("no ',' or ']'");
            }
        }

        string String()
        {
            var b = new StringBuilder();
            at++;
            for (;;)
            {
                byte c = Peek();
                if (c == '"') { at++; return b.ToString(); }
                if (c < 0x20) Fail("a control character in a string");
                if (c != '\\')
                {
                    int start = at;
                    while (at < end && text[at] != '"' && text[at] != '\\' && text[at] >= 0x20) at++;
                    b.Append(Encoding.UTF8.GetString(text, start, at - start));
                    continue;
                }
                at++;
                c = Peek();
                at++;
                int i = "\"\\/bfnrt".IndexOf((char)c);
                if (i >= 0) { b.Append("\"\\/\b\f\n\r\t"[i]); continue; }
                if (c != 'u' || end - at < 4) Fail("a bad escape");
                int code;
                if (!int.TryParse(Encoding.ASCII.GetString(text, at, 4), NumberStyles.AllowHexSpecifier, CultureInfo.InvariantCulture, out code)) Fail("a bad \\u escape");
                b.Append((char)code);
                at += 4;
            }
        }

        object Number()
        {
            int start = at;
            if (at < end && text[at] == '-') at++;
            int digits = at;
            while (at < end && text[at] >= '0' && text[at] <= '9') at++;
            if (at == digits) Fail("an unexpected character");
            if (at < end && text[at] == '.') { at++; int f = at; while (at < end && text[at] >= '0' && text[at] <= '9') at++; if (at == f) Fail("a bad number"); }
            if (at < end && (text[at] == 'e' || text[at] == 'E'))
            {
                at++;
                if (at < end && (text[at] == '+' || text[at] == '-')) at++;
                int e = at;
                while (at < end && text[at] >= '0' && text[at] <= '9') at++;
                if (at == e) Fail("a bad exponent");
            }
            double v;
            if (!double.TryParse(Encoding.ASCII.GetString(text, start, at - start), NumberStyles.Float, CultureInfo.InvariantCulture, out v)
                || double.IsInfinity(v)) Fail("a number out of range");
            return v;
        }

        NdArray NdArrayOf(object nd)
        {
            var d = nd as List<object>;
            if (d == null || d.Count != 4 || !(d[0] is string) || !(d[1] is List<object>)) Fail("a bad __nd__ descriptor");
            int[] shape = Ints(d[1], "an array's shape", 0, int.MaxValue);
            if (!IsInt(d[2], 0, data.Length) || !IsInt(d[3], 0, data.Length)) Fail("an array outside the data");
            int offset = (int)(double)d[2], nbytes = (int)(double)d[3];
            if (offset % 8 != 0 || (long)dataStart + offset + nbytes > data.Length) Fail("an array outside the data");
            var a = new NdArray { Dtype = (string)d[0], Shape = shape, Data = new byte[nbytes] };
            long count = 1;
            foreach (int n in shape) count *= n;
            int size = a.Dtype == "<f4" || a.Dtype == "<i4" ? 4 : a.Dtype == "<f8" || a.Dtype == "<i8" ? 8 : 1;
            if (count * size != nbytes) Fail("an array whose nbytes do not fit its shape");
            Buffer.BlockCopy(data, dataStart + offset, a.Data, 0, nbytes);
            return a;
        }

        public static bool IsInt(object v, double lo, double hi)
        {
            return v is double && (double)v == Math.Floor((double)v) && (double)v >= lo && (double)v <= hi;
        }

        public static int[] Ints(object v, string what, double lo, double hi)
        {
            var list = v as List<object>;
            if (list == null || list.Count < 1 || list.Count > 64) throw new ShmrlException("SET_CONFIG: " + what + " is not a list of 1 to 64 ints");
            int[] a = new int[list.Count];
            for (int i = 0; i < a.Length; i++)
            {
                if (!IsInt(list[i], lo, hi)) throw new ShmrlException("SET_CONFIG: " + what + " holds " + list[i] + ", not an int of " + lo + " to " + hi);
                a[i] = (int)(double)list[i];
            }
            return a;
        }

        public static float[] FloatList(object v)
        {
            var list = v as List<object>;
            if (list == null) return null;
            float[] a = new float[list.Count];
            for (int i = 0; i < a.Length; i++) { if (!(list[i] is double)) return null; a[i] = (float)(double)list[i]; }
            return a;
        }

        /// <summary>K actions of a JSON list: [a, ...] (dim 0: a Discrete) or [[a, ...], ...] of dim each.</summary>
        public static double[] Flatten(object v, int k, int dim)
        {
            var list = v as List<object>;
            if (list == null || list.Count != k) throw new ShmrlException("ACTIONS: actions is not a list of " + k);
            double[] values = new double[k * Math.Max(dim, 1)];
            for (int i = 0; i < k; i++)
            {
                if (dim == 0) { if (!(list[i] is double)) throw new ShmrlException("ACTIONS: a Discrete action that is not a number"); values[i] = (double)list[i]; continue; }
                var row = list[i] as List<object>;
                if (row == null || row.Count != dim) throw new ShmrlException("ACTIONS: actions of the wrong shape");
                for (int j = 0; j < dim; j++) { if (!(row[j] is double)) throw new ShmrlException("ACTIONS: an action that is not a number"); values[i * dim + j] = (double)row[j]; }
            }
            return values;
        }

        // Writers: Python's separators; floats with a decimal point (1.0), as Python writes them.
        public static string Quote(string s)
        {
            var b = new StringBuilder("\"");
            foreach (char c in s)
            {
                if (c == '"' || c == '\\') b.Append('\\').Append(c);
                else if (c < 0x20 || c > 0x7e) b.Append("\\u").Append(((int)c).ToString("x4"));   // json.dumps' ensure_ascii
                else b.Append(c);
            }
            return b.Append('"').ToString();
        }

        public static void Float(StringBuilder b, float v)
        {
            string s = v.ToString("R", CultureInfo.InvariantCulture);
            b.Append(s);
            if (s.IndexOf('.') < 0 && s.IndexOf('E') < 0) b.Append(".0");
        }

        public static void Floats(StringBuilder b, float[] a, int from, int n)
        {
            b.Append('[');
            for (int i = 0; i < n; i++) { if (i > 0) b.Append(", "); Float(b, a[from + i]); }
            b.Append(']');
        }

        public static string Bools(bool[] a, int n)
        {
            var parts = new string[n];
            for (int i = 0; i < n; i++) parts[i] = a != null && a[i] ? "true" : "false";
            return "[" + string.Join(", ", parts) + "]";
        }

        /// <summary>Row-major floats as nested lists of `shape` from dimension d on.</summary>
        public static void Nested(StringBuilder b, float[] a, int[] shape, int d, ref int at)
        {
            if (d == shape.Length - 1) { Floats(b, a, at, shape[d]); at += shape[d]; return; }
            b.Append('[');
            for (int i = 0; i < shape[d]; i++) { if (i > 0) b.Append(", "); Nested(b, a, shape, d + 1, ref at); }
            b.Append(']');
        }
    }
}
