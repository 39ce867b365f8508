// The tokenizer's gRPC contract as a Node.js client meets it: @grpc/grpc-js
// with the .proto files loaded by @grpc/proto-loader, and the error details
// (google.rpc.Status in grpc-status-details-bin) decoded by protobufjs, as a
// service written in JavaScript would. It reports what it saw, one JSON
// object a line; tests/e2e/test_other_clients.py compares that with what
// the Python client gets from the same server.
//
//   node contract.js ADDRESS PROTOS_DIR GOOGLEAPIS_DIR IMAGE_FILE

"use strict";

const fs = require("node:fs");
const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const loader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");

const [address, protosDir, googleapisDir, imageFile] = process.argv.slice(2);
const LOADING = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };

function load(files, dirs) {
  return grpc.loadPackageDefinition(loader.loadSync(files, { ...LOADING, includeDirs: dirs }));
}

const mmsplit = load(["mmsplit/tokenizer/v1/tokenizer.proto"], [protosDir]).mmsplit;
const health = load([path.join(__dirname, "health.proto")], []).grpc.health.v1;
const tokenizer = new mmsplit.tokenizer.v1.TokenizerService(address, grpc.credentials.createInsecure());
// The same service with its requests gzip-compressed, as a client may configure.
const gzipped = new mmsplit.tokenizer.v1.TokenizerService(address, grpc.credentials.createInsecure(), {
  "grpc.default_compression_algorithm": 2,
});
const checker = new health.Health(address, grpc.credentials.createInsecure());

// google.rpc.Status and ErrorInfo, from the googleapis files Python's
// googleapis-common-protos ships (protobufjs has google/protobuf/* built in).
const rpc = new protobuf.Root();
rpc.resolvePath = (origin, target) =>
  target.startsWith("google/protobuf/") ? target : path.join(googleapisDir, target);
rpc.loadSync(["google/rpc/status.proto", "google/rpc/error_details.proto"]);
const Status = rpc.lookupType("google.rpc.Status");
const ErrorInfo = rpc.lookupType("google.rpc.ErrorInfo");

function report(check, fields) {
  process.stdout.write(JSON.stringify({ check, ...fields }) + "\n");
}

function deadline(seconds) {
  return new Date(Date.now() + seconds * 1000);
}

function unary(client, method, request, seconds = 30) {
  return new Promise((resolve, reject) =>
    client[method](request, { deadline: deadline(seconds) }, (err, reply) => (err ? reject(err) : resolve(reply))),
  );
}

// What a failed call says: its code, its message, and our ErrorInfo.
function failure(err) {
  const out = { code: err.code, message: err.details };
  for (const raw of err.metadata.get("grpc-status-details-bin")) {
    const status = Status.decode(raw);
    out.status_code = status.code;
    for (const detail of status.details) {
      if (detail.type_url === "type.googleapis.com/google.rpc.ErrorInfo") {
        const info = ErrorInfo.decode(detail.value);
        out.reason = info.reason;
        out.domain = info.domain;
        out.metadata = info.metadata;
      }
    }
  }
  return out;
}

// A Generate call's events; `onEvent` may cancel it. Resolves with what
// came and how it ended (never rejects: a failure is part of the report).
function generate(request, { seconds = 60, onEvent = () => {}, client = tokenizer } = {}) {
  return new Promise((resolve) => {
    const events = [];
    const call = client.Generate(request, { deadline: deadline(seconds) });
    call.on("data", (event) => {
      events.push(event);
      onEvent(call, event);
    });
    call.on("error", (err) => resolve({ events, error: failure(err) }));
    call.on("end", () => resolve({ events, error: null }));
  });
}

function summary({ events, error }) {
  const deltas = events.filter((e) => e.event === "delta").map((e) => e.delta);
  const finished = events.filter((e) => e.event === "finished").map((e) => e.finished);
  return {
    kinds: events.map((e) => e.event).filter((kind, i, all) => kind !== all[i - 1]), // runs of one kind as one
    request_ids: [...new Set(events.map((e) => e.request_id))],
    token_ids: deltas.flatMap((d) => d.token_ids),
    text: deltas.map((d) => d.text).join(""),
    finished: finished[0] || null,
    error,
  };
}

async function main() {
  const image = fs.readFileSync(imageFile);
  for (const service of ["", "mmsplit.tokenizer.v1.TokenizerService"]) {
    const reply = await unary(checker, "Check", { service });
    report("health", { service, status: reply.status });
  }
  const info = await unary(tokenizer, "GetServerInfo", {});
  report("info", { model: info.info.model, scheduler_model: info.scheduler.model, transport: info.transport });

  const looking = { prompt: "Describe this picture: <image>", images: [{ data: image }] };
  const tokens = await unary(tokenizer, "Tokenize", { request: looking });
  report("tokenize", { token_ids: tokens.token_ids });

  const greedy = { ...looking, sampling: { max_tokens: 6, min_tokens: 6 } };
  report("generate", summary(await generate(greedy)));
  report("generate gzip", summary(await generate(greedy, { client: gzipped })));

  const corrupt = { prompt: "Describe <image>", images: [{ data: image.subarray(0, 300) }] };
  report("corrupt image", summary(await generate({ ...corrupt, sampling: { max_tokens: 2 } })));

  // Long enough not to finish before the deadline or the cancel.
  const long = { prompt: "Count:", sampling: { max_tokens: 900, min_tokens: 900 } };
  report("deadline", summary(await generate(long, { seconds: 0.3 })));
  report("cancel", summary(await generate(long, { onEvent: (call, event) => event.event === "delta" && call.cancel() })));

  for (const client of [tokenizer, gzipped, checker]) client.close();
}

main().catch((err) => {
  process.stderr.write(`${err.stack || err}\n`);
  process.exit(1);
});
