//! Tests that need no server: the command line's handling of bad input,
//! secrets kept out of every output, the document contract under
//! generated input, the docs' links, and the writers in other languages
//! held to the contract's constants.

mod cli;
mod contract_fuzz;
mod deploy;
mod docs;
mod secrets;
mod writers;
