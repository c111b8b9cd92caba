//! The model: its configuration ([`config`]).

pub mod config;
