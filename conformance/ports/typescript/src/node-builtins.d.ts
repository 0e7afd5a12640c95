// node-builtins.d.ts: the part of Node's built-in API this port uses, declared by hand.
//
// `typescript` is the port's only dev dependency, so there is no @types/node: each
// declaration below is the Node 18 documented signature of one thing the port calls,
// narrowed to how it is called.  A name missing here is a name the port does not use.

interface Buffer extends Uint8Array {
  toString(encoding?: "utf8" | "utf-8" | "hex"): string;
}
declare var Buffer: {
  from(text: string, encoding?: "utf8"): Buffer;
  concat(chunks: readonly Uint8Array[]): Buffer;
  alloc(size: number): Buffer;
  byteLength(text: string, encoding?: "utf8"): number;
};

interface WritableStdio {
  write(chunk: string): boolean;
}
declare var process: {
  readonly env: Record<string, string | undefined>;
  readonly argv: string[];
  stdout: WritableStdio;
  stderr: WritableStdio;
  exitCode: number | undefined;
  exit(code?: number): never;
  once(event: "SIGTERM" | "SIGINT", listener: () => void): void;
};

interface Timeout {
  unref(): Timeout;
}
declare function setTimeout(callback: () => void, ms: number): Timeout;
declare function clearTimeout(timer: Timeout | undefined): void;
declare function structuredClone<T>(value: T): T;

declare var performance: { now(): number };

interface ImportMeta {
  readonly url: string;
}

declare class TextDecoder {
  constructor(label?: "utf-8", options?: { fatal?: boolean });
  decode(input: Uint8Array): string;
}

declare class URL {
  constructor(input: string, base?: string | URL);
  readonly protocol: string;
  readonly hostname: string;
  readonly port: string;
  readonly pathname: string;
  readonly href: string;
  toString(): string;
}

declare module "node:async_hooks" {
  export class AsyncLocalStorage<T> {
    run<R>(store: T, callback: () => R): R;
    getStore(): T | undefined;
  }
}

declare module "node:crypto" {
  interface Hash {
    update(data: string, encoding: "utf8"): Hash;
    digest(): Buffer;
    digest(encoding: "hex"): string;
  }
  export function createHash(algorithm: "sha256"): Hash;
  export function randomUUID(): string;
  export function timingSafeEqual(a: Uint8Array, b: Uint8Array): boolean;
}

declare module "node:net" {
  export interface Socket {
    setNoDelay(noDelay?: boolean): Socket;
  }
  export interface AddressInfo {
    address: string;
    family: string;
    port: number;
  }
}

declare module "node:http" {
  import type { AddressInfo, Socket } from "node:net";

  export type IncomingHttpHeaders = Record<string, string | string[] | undefined>;
  export type OutgoingHttpHeaders = Record<string, string>;

  export class Agent {
    constructor(options?: { keepAlive?: boolean });
    destroy(): void;
  }

  export interface IncomingMessage extends AsyncIterable<Buffer> {
    readonly method?: string;
    readonly url?: string;
    readonly statusCode?: number;
    readonly headers: IncomingHttpHeaders;
    on(event: "data", listener: (chunk: Buffer) => void): IncomingMessage;
    on(event: "end" | "close", listener: () => void): IncomingMessage;
    on(event: "error", listener: (err: Error) => void): IncomingMessage;
  }

  export interface ServerResponse {
    readonly headersSent: boolean;
    writeHead(status: number, headers: string[] | OutgoingHttpHeaders): ServerResponse;
    end(body?: string | Uint8Array): ServerResponse;
  }

  export interface ClientRequest {
    readonly reusedSocket: boolean;
    on(event: "response", listener: (response: IncomingMessage) => void): ClientRequest;
    on(event: "error", listener: (err: Error) => void): ClientRequest;
    end(body?: string | Uint8Array): ClientRequest;
    destroy(): void;
  }

  export interface RequestOptions {
    method?: string;
    headers?: OutgoingHttpHeaders;
    agent?: Agent | false;
  }

  export interface Server {
    listen(port: number, host: string, callback: () => void): Server;
    address(): AddressInfo | string | null;
    close(callback?: (err?: Error) => void): Server;
    /** Node 18.2+: optional, so the port still runs (and closes) on 18.0 and 18.1. */
    closeIdleConnections?(): void;
    closeAllConnections?(): void;
    on(event: "connection", listener: (socket: Socket) => void): Server;
    once(event: "error", listener: (err: Error) => void): Server;
    off(event: "error", listener: (err: Error) => void): Server;
  }

  export function createServer(
    options: { requestTimeout?: number; headersTimeout?: number },
    listener: (req: IncomingMessage, res: ServerResponse) => void,
  ): Server;
  export function request(url: URL, options: RequestOptions): ClientRequest;

  const http: { Agent: typeof Agent; createServer: typeof createServer; request: typeof request };
  export default http;
}

declare module "node:https" {
  import type { Agent as HttpAgent, ClientRequest, RequestOptions } from "node:http";

  export class Agent extends HttpAgent {}
  export function request(url: URL, options: RequestOptions): ClientRequest;

  const https: { Agent: typeof Agent; request: typeof request };
  export default https;
}

declare module "node:fs" {
  export function readFileSync(path: URL | string, encoding: "utf8"): string;
}

declare module "node:util" {
  export function isDeepStrictEqual(a: unknown, b: unknown): boolean;
}

declare module "node:assert" {
  interface Assert {
    equal(actual: unknown, expected: unknown, message?: string): void;
    deepEqual(actual: unknown, expected: unknown, message?: string): void;
    ok(value: unknown, message?: string): void;
    throws(fn: () => unknown, expected?: (new (...args: never[]) => Error) | ((err: unknown) => boolean)): void;
    rejects(promise: Promise<unknown>, expected?: (new (...args: never[]) => Error) | ((err: unknown) => boolean)): Promise<void>;
  }
  export const strict: Assert;
}

declare module "node:test" {
  export interface TestContext {
    test(name: string, fn: (t: TestContext) => void | Promise<void>): Promise<void>;
    skip(message?: string): void;
    diagnostic(message: string): void;
  }
  export function test(name: string, fn: (t: TestContext) => void | Promise<void>): Promise<void>;
  export function before(fn: () => void | Promise<void>): void;
  export function after(fn: () => void | Promise<void>): void;
}

