//! Tests that need no server: the command line's handling of bad input,
//! secrets kept out of every output, the document contract under
//! generated input, and the docs' links.

mod cli;
mod contract_fuzz;
mod deploy;
mod docs;
mod secrets;
