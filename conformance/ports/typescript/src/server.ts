#!/usr/bin/env node
// server.ts: serve the conformance agent through this port's dispatch server.
//
//   node dist/server.js [--host 127.0.0.1] [--port 8080] [--path /dispatch]
//       [--token-env AGENT_TOKEN] [--auth-header Authorization] [--no-auth] [--strict]
//       [--max-body BYTES] [--timeout SECONDS] [--grace SECONDS]
//
// Prints "listening on http://HOST:PORT/PATH" once listening.  SIGTERM or
// SIGINT: refuse new dispatches, let in-flight ones finish (up to --grace s).
// Responses are built leniently (§4: what the platform would drop is dropped
// the same way, each change logged); --strict, or PIPELINES_PORT_STRICT=1 read
// at each response, answers 500 instead.

import { conformanceAgent } from "./conformance_agent.js";
import { DEFAULT_DISPATCH_PATH, DEFAULT_TOKEN_ENV, DispatchApp, defaultClient, log, startServer } from "./pipelines_port.js";
import type { DispatchOptions, RunningServer } from "./pipelines_port.js";

const USAGE = "usage: node dist/server.js [--host HOST] [--port PORT] [--path /dispatch] [--token-env NAME] " +
  "[--auth-header NAME] [--no-auth] [--strict] [--max-body BYTES] [--timeout SECONDS] [--grace SECONDS]";

class UsageError extends Error {}

interface Options extends DispatchOptions {
  host: string;
  port: number;
  graceS: number;
}

type Parser = (text: string, flag: string) => string | number;

const number = (check: (value: number) => boolean, what: string): Parser => (text, flag) => {
  const value = Number(text);
  if (text.trim() === "" || !check(value)) throw new UsageError(`${flag} must be ${what}, got ${JSON.stringify(text)}`);
  return value;
};
const port = number((v) => Number.isInteger(v) && v >= 0 && v <= 65535, "a port number (0 picks a free one)");
const positiveInt = number((v) => Number.isInteger(v) && v > 0, "a positive integer");
const positive = number((v) => Number.isFinite(v) && v > 0, "a positive number");
const text: Parser = (value) => value;

// flag -> [option name, parser]; a null parser marks a switch.
const FLAGS: Record<string, [keyof Options, Parser | null]> = {
  "--host": ["host", text],
  "--port": ["port", port],
  "--path": ["path", text],
  "--token-env": ["tokenEnv", text],
  "--auth-header": ["authHeader", text],
  "--no-auth": ["noAuth", null],
  "--strict": ["strict", null],
  "--max-body": ["maxBody", positiveInt],
  "--timeout": ["runTimeoutS", positive],
  "--grace": ["graceS", positive],
};

function parseArgs(argv: readonly string[]): Options {
  const options: Record<string, string | number | boolean> = {
    host: "127.0.0.1", port: 8080, path: DEFAULT_DISPATCH_PATH, tokenEnv: DEFAULT_TOKEN_ENV, graceS: 30,
  };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i] ?? "";
    const eq = arg.startsWith("--") ? arg.indexOf("=") : -1;
    const flag = eq < 0 ? arg : arg.slice(0, eq);
    const inline = eq < 0 ? undefined : arg.slice(eq + 1);
    if (flag === "-h" || flag === "--help") throw new UsageError(USAGE);
    const known = FLAGS[flag];
    if (known === undefined) throw new UsageError(`unknown argument ${JSON.stringify(arg)}\n${USAGE}`);
    const [name, parse] = known;
    if (parse === null) {
      options[name] = true;
      continue;
    }
    const value = inline ?? argv[++i];
    if (value === undefined) throw new UsageError(`${flag} needs a value`);
    options[name] = parse(value, flag);
  }
  return options as unknown as Options; // every key was set by a parser of its own type
}

async function main(argv: readonly string[]): Promise<number> {
  let options: Options;
  let app: DispatchApp;
  try {
    options = parseArgs(argv);
    const { host: _host, port: _port, graceS: _grace, ...appOptions } = options;
    app = new DispatchApp(conformanceAgent, appOptions);
  } catch (err) {
    if (!(err instanceof UsageError || err instanceof RangeError)) throw err;
    process.stderr.write(`server.js: ${err.message}\n`);
    return 2;
  }
  let running: RunningServer;
  try {
    running = await startServer(app, { host: options.host, port: options.port });
  } catch (err) {
    const reason = (err as { code?: string }).code ?? (err instanceof Error ? err.message : String(err));
    process.stderr.write(`server.js: cannot listen on ${options.host}:${options.port}: ${reason}\n`);
    return 2;
  }
  process.stdout.write(`pipelines_port (typescript) serve: listening on ${running.url}\n`);
  process.stdout.write(`pipelines_port (typescript) serve: auth: ${app.describeAuth()}\n`);

  const signal = await new Promise<string>((resolve) => {
    process.once("SIGTERM", () => resolve("SIGTERM"));
    process.once("SIGINT", () => resolve("SIGINT"));
  });
  log("info", `${signal}: refusing new dispatches, waiting up to ${options.graceS} s for in-flight ones`);
  const finished = await running.close(options.graceS);
  if (!finished) log("warning", "grace period over with dispatches still running; exiting anyway");
  defaultClient().close();
  return finished ? 0 : 1;
}

// Exit explicitly: an agent still running past the grace period must not keep the process alive.
process.exit(await main(process.argv.slice(2)));
