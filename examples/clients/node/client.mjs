// An rlfleet client in Node.js, built from protos/ alone: health, version, status, submit prompts,
// stream one batch, decode its tensors, ragged and string entries, ack it, and a malformed tensor.
//
//   npm install && node client.mjs <collector host:port> [batch_size]
//
// Prints one JSON object (the decoded batch summarised) on stdout. 64-bit integers (group ids may
// exceed 2^53) are decoded as BigInt and printed as decimal strings.
import { fileURLToPath } from "node:url";
import path from "node:path";
import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const PROTOS = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../../../protos");
const definition = protoLoader.loadSync(
  ["rlfleet/v1/collector.proto", "rlfleet/v1/trajectory.proto", "grpc/health/v1/health.proto"],
  { includeDirs: [PROTOS], keepCase: true, longs: String, enums: String, defaults: true, oneofs: true });
const proto = grpc.loadPackageDefinition(definition);

const [address, batchArg] = process.argv.slice(2);
const batchSize = Number(batchArg ?? 4);
const credentials = grpc.credentials.createInsecure();
const collector = new proto.rlfleet.v1.CollectorService(address, credentials);
const trajectory = new proto.rlfleet.v1.TrajectoryService(address, credentials);
const health = new proto.grpc.health.v1.Health(address, credentials);
const deadline = () => new Date(Date.now() + 60_000);
const call = (client, method, request) => new Promise((resolve, reject) =>
  client[method](request, { deadline: deadline() }, (err, reply) => (err ? reject(err) : resolve(reply))));

// --- decoding (tensor.proto): little-endian bytes in the named dtype, shape row-major -------------
const DTYPES = {
  DTYPE_FLOAT32: [4, (v, o) => v.getFloat32(o, true)],
  DTYPE_FLOAT64: [8, (v, o) => v.getFloat64(o, true)],
  DTYPE_INT64: [8, (v, o) => v.getBigInt64(o, true)],
  DTYPE_INT32: [4, (v, o) => v.getInt32(o, true)],
  DTYPE_INT16: [2, (v, o) => v.getInt16(o, true)],
  DTYPE_INT8: [1, (v, o) => v.getInt8(o)],
  DTYPE_UINT8: [1, (v, o) => v.getUint8(o)],
  DTYPE_BOOL: [1, (v, o) => v.getUint8(o) !== 0],
};

function decodeTensor(tensor) {
  const [size, read] = DTYPES[tensor.dtype] ?? (() => { throw new Error(`dtype ${tensor.dtype}`); })();
  const shape = tensor.shape.map(Number);
  const count = shape.reduce((a, b) => a * b, 1);
  const view = new DataView(tensor.data.buffer, tensor.data.byteOffset, tensor.data.byteLength);
  if (view.byteLength !== count * size) throw new Error(`${view.byteLength} bytes for shape [${shape}]`);
  return { shape, values: Array.from({ length: count }, (_, i) => read(view, i * size)) };
}

function decodeRagged(ragged) {
  const values = decodeTensor(ragged.values);
  const row = values.shape.slice(1).reduce((a, b) => a * b, 1);
  let start = 0;
  return ragged.lengths.map(Number).map((length) => {
    const sample = values.values.slice(start * row, (start + length) * row);
    start += length;
    return sample;
  });
}

function decodeTensorDict(td, prefix = "", out = {}) {
  for (const [key, value] of Object.entries(td.entries)) {
    const name = prefix + key;
    if (value.kind === "tensor") out[name] = { kind: "tensor", ...decodeTensor(value.tensor) };
    else if (value.kind === "ragged") out[name] = { kind: "ragged", samples: decodeRagged(value.ragged) };
    else if (value.kind === "strings") out[name] = { kind: "strings", values: value.strings.values };
    else decodeTensorDict(value.nested, `${name}/`, out);
  }
  return out;
}

// --- one batch: open, receive, ack, read the server's answer, half-close -----------------------------
// A response carries either a batch (lease_id set) or `settled`: the answer to an ack or nack.
function streamOneBatch() {
  return new Promise((resolve, reject) => {
    const stream = trajectory.StreamBatches({ deadline: new Date(Date.now() + 600_000) });
    let got = null;
    let settled = null;
    stream.on("data", (message) => {
      if (message.settled) {
        if (got && message.settled.lease_id === got.lease_id) settled = message.settled;
        stream.end(); // half-close: the server ends the stream (releasing anything else it sent)
      } else if (!got) {
        got = message;
        stream.write({ ack: { lease_id: message.lease_id } });
      }
    });
    stream.on("error", reject);
    stream.on("end", () => (got ? resolve({ message: got, settled })
                                : reject(new Error("stream ended without a batch"))));
    stream.write({ open: { batch_size: batchSize, whole_groups: true } });
  });
}

const summary = {};
summary.health = (await call(health, "Check", { service: "rlfleet.v1.CollectorService" })).status;
summary.version_before = (await call(collector, "GetPolicyVersion", {})).version;
const status = await call(collector, "GetStatus", {});
summary.group_size = status.group_size;
const groups = Math.max(1, Math.floor(batchSize / status.group_size));
const prompts = Array.from({ length: groups }, (_, i) => ({
  prompt: { text: `answer in digits: node ${i}` }, reward_fn: "char_fraction", reward_args: { pattern: "[0-9]" } }));
summary.prompt_ids = (await call(collector, "SubmitPrompts", { prompts })).prompt_ids;

const { message, settled } = await streamOneBatch();
const batch = decodeTensorDict(message.batch);
summary.lease_id = message.lease_id;
summary.ack = settled && { lease_id: settled.lease_id, applied: settled.applied,
                           trajectories: settled.trajectories, reason: settled.reason };
summary.batch_size = message.batch.batch_size.map(Number);
summary.keys = Object.fromEntries(Object.entries(batch).map(([k, v]) => [k, v.kind]));
const str = (values) => values.map((v) => (typeof v === "bigint" ? v.toString() : v));
summary.group_id = str(batch.group_id.values);
summary.group_id_hex = batch.group_id.values.map((v) => BigInt.asUintN(64, v).toString(16));
summary.sample_index = str(batch.sample_index.values);
summary.trajectory_id = batch.trajectory_id.values;
summary.prompt_id = batch.prompt_id.values;
summary.response_lengths = batch["tokens/response"].samples.map((s) => s.length);
summary.prompt_lengths = batch["tokens/prompt"].samples.map((s) => s.length);
summary.full_lengths = batch["tokens/full"].samples.map((s) => s.length);
summary.log_prob_lengths = batch["log_probs/response"].samples.map((s) => s.length);
summary.log_prob_sums = batch["log_probs/response"].samples.map((s) => s.reduce((a, b) => a + b, 0));
summary.token_versions = batch["versions/response"].samples.map((s) => [...new Set(s.map(String))]);
summary.version_start = str(batch.policy_version_start.values);
summary.done_shape = batch["next/done"].shape;
summary.done = batch["next/done"].values;
summary.advantage = batch.advantage.values;
summary.score = batch.score.values;

// A malformed tensor (3 bytes for one int64 token id) must come back INVALID_ARGUMENT naming it.
try {
  await call(collector, "SubmitPrompts", { prompts: [{ prompt: { token_ids: {
    dtype: "DTYPE_INT64", shape: [1], data: Buffer.from([1, 2, 3]) } } }] });
  summary.malformed = { code: "OK" };
} catch (err) {
  summary.malformed = { code: grpc.status[err.code], details: err.details };
}
console.log(JSON.stringify(summary));
collector.close(); trajectory.close(); health.close();
