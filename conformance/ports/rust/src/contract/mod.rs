//! PART 1 of `pipelines_port.py`, "THE CONTRACT": every rule of CONTRACT.md as
//! data and pure functions. Nothing in this module does I/O, spawns a thread,
//! reads the environment or logs; the drivers (`blocking`, `aio`) and the
//! server adapter (`server`) carry its decisions out.
//!
//! | module | Python section | CONTRACT |
//! |---|---|---|
//! | [`constants`] | Constants: the contract's names and numbers | §2.1, §2.2, §3.1, §3.3, §3.4 |
//! | [`errors`] | Errors | §7.1 kit-error-statuses |
//! | [`json`] | (`_decode_body`, `_well_formed`) | §7.7 kit-json-safe-response |
//! | [`envelope`] | Envelope (§2 dispatch) | §2.2, §7.2 |
//! | [`inbound`] | Inbound decisions | §2.3 steps 1-5, §7.1 |
//! | [`encoding`] | Request encoding | §3.1, §3.4, §3.5, §7.5 |
//! | [`reply`] | Reply interpretation and the retry decision | §3.2, §3.3, §7.4 |
//! | [`response`] | Response envelope: building and validation | §4, §7.7 |
//! | [`replies`] | HTTP replies of a dispatch endpoint; redaction | §2.3 step 8, §7.3, §7.6 |

pub mod constants;
pub mod encoding;
pub mod envelope;
pub mod errors;
pub mod inbound;
pub mod json;
pub mod replies;
pub mod reply;
pub mod response;
