//! Test support: a local server speaking the OpenAI chat-completions wire format.

#![allow(dead_code)]

pub mod openai_server;
