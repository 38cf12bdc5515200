//! Test support: a local server speaking the OpenAI chat-completions wire format, and a
//! tracing layer that records spans.

#![allow(dead_code)]

pub mod mesh;
pub mod openai_server;
pub mod spans;
