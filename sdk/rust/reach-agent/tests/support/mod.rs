//! Test support: a local server speaking the OpenAI chat-completions wire format, and a
//! tracing layer that records spans, a registry and router, and the tools tests share.

#![allow(dead_code)]

pub mod mesh;
pub mod openai_server;
pub mod spans;
pub mod tools;
