// A Node.js client of the MicroServing Router service (proto/microserving/v1/router.proto).
//
// On one bidirectional Router.Generate stream it starts two requests: "full" streams to the
// end, "cancelled" is cancelled after its first delta. Prints one JSON object with both
// results. Usage: node client.js HOST:PORT [prompt]
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'proto');

function loadRouterService() {
  const definition = protoLoader.loadSync('microserving/v1/router.proto', {
    includeDirs: [PROTO_ROOT],
    keepCase: true,
    longs: Number,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).microserving.v1.Router;
}

function newResult() {
  return { token_ids: [], text: '', finish_reasons: [], usage: null, engines: [], error: null };
}

function run(address, prompt) {
  const Router = loadRouterService();
  const client = new Router(address, grpc.credentials.createInsecure());
  const results = { full: newResult(), cancelled: newResult() };
  const call = client.Generate();
  let open = 2;

  return new Promise((resolve, reject) => {
    const deadline = setTimeout(() => {
      call.cancel();
      reject(new Error('timed out'));
    }, 120000);

    call.on('data', (message) => {
      const result = results[message.request_id];
      if (!result) return;
      switch (message.event) {
        case 'delta':
          result.token_ids.push(...message.delta.token_ids);
          result.text += message.delta.text;
          if (message.request_id === 'cancelled' && result.token_ids.length > 0 && !result.cancel_sent) {
            result.cancel_sent = true;
            call.write({ cancel: { request_id: 'cancelled' } });
          }
          break;
        case 'finish':
          result.finish_reasons.push(message.finish.reason);
          break;
        case 'done':
          result.usage = message.done.usage;
          result.engines = message.done.engines;
          open -= 1;
          break;
        case 'error':
          result.error = { code: message.error.code, message: message.error.message, param: message.error.param };
          open -= 1;
          break;
        default:
          break;
      }
      if (open === 0) call.end();
    });
    call.on('error', (err) => {
      clearTimeout(deadline);
      reject(err);
    });
    call.on('end', () => {
      clearTimeout(deadline);
      client.close();
      for (const r of Object.values(results)) delete r.cancel_sent;
      resolve(results);
    });

    const sampling = { temperature: 0, max_tokens: 16 };
    call.write({ generate: { request_id: 'full', text: prompt, sampling } });
    call.write({
      generate: { request_id: 'cancelled', text: prompt, sampling: { temperature: 0, max_tokens: 400, ignore_eos: true } },
    });
  });
}

if (require.main === module) {
  const [address, prompt = 'Hello from Node.js'] = process.argv.slice(2);
  if (!address) {
    console.error('usage: node client.js HOST:PORT [prompt]');
    process.exit(2);
  }
  run(address, prompt)
    .then((results) => console.log(JSON.stringify(results)))
    .catch((err) => {
      console.error(err.message);
      process.exit(1);
    });
}

module.exports = { run };
