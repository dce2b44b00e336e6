// One round of BullMQ for bench/peers.py (copied beside its node_modules at run time).
// Usage: node peers_bullmq.js PORT N CONCURRENCY; prints one JSON line, as peers_drivers.py does:
// enqueue N no-op jobs with Queue.add (CONCURRENCY callers, each awaiting its own), then time a
// Worker of CONCURRENCY until all N are completed. Redis CPU from INFO cpu deltas, the client's
// own from process.cpuUsage().
"use strict";
const { Queue, Worker } = require("bullmq");
const IORedis = require("ioredis");

const [port, n, concurrency] = process.argv.slice(2).map(Number);
const connection = { host: "127.0.0.1", port, maxRetriesPerRequest: null };
const DEADLINE_MS = 120000;

async function redisCpu(r) {
  const info = await r.info("cpu");
  const get = (name) => Number(new RegExp(`${name}:([0-9.]+)`).exec(info)[1]);
  return get("used_cpu_sys") + get("used_cpu_user");
}

const now = () => Number(process.hrtime.bigint()) / 1e9;
const ownCpu = () => { const u = process.cpuUsage(); return (u.user + u.system) / 1e6; };

async function main() {
  const r = new IORedis(connection);
  const queue = new Queue("peers", { connection });
  await queue.waitUntilReady();
  const marks = [];
  const mark = async () => marks.push([now(), await redisCpu(r), ownCpu()]);

  await mark();
  let next = 0;
  await Promise.all(Array.from({ length: concurrency }, async () => {
    while (next < n) {
      next += 1;
      await queue.add("noop", {});
    }
  }));
  await mark();

  const times = [];
  let worker;
  const done = new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`only ${times.length} of ${n} in time`)),
      DEADLINE_MS);
    worker = new Worker("peers", async () => null, { connection, concurrency, autorun: false });
    worker.on("completed", () => {
      times.push(now());
      if (times.length >= n) { clearTimeout(timer); resolve(); }
    });
  });
  await mark();
  worker.run();
  await done;
  await mark();
  await worker.close();
  await queue.close();
  r.disconnect();

  let gap = 0;
  for (let i = 1; i < times.length; i++) gap = Math.max(gap, times[i] - times[i - 1]);
  const [[t0, c0, p0], [t1, c1, p1], [t2, c2, p2], [t3, c3, p3]] = marks;
  console.log(JSON.stringify({
    enqueue_per_s: n / (t1 - t0), process_per_s: n / (t3 - t2),
    cpu_enq_us: (c1 - c0) / n * 1e6, cpu_proc_us: (c3 - c2) / n * 1e6,
    client_enq_us: (p1 - p0) / n * 1e6, client_proc_us: (p3 - p2) / n * 1e6,
    max_gap_ms: gap * 1000,
  }));
}

main().catch((err) => { console.error(err); process.exit(1); });
