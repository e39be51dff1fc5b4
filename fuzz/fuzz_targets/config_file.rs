//! Fuzz target: see `kvroute::fuzzing::config_file`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute::fuzzing::config_file(data));
