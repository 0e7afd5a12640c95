import type { AgentResult, Envelope } from "./pipelines_port.js";
/** The agent: echo mode, or script mode when user_instruction is a JSON object with a `steps` array. */
export declare function conformanceAgent(envelope: Envelope): Promise<AgentResult>;
