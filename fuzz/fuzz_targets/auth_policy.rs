//! Fuzz target: see `kvroute::fuzzing::auth_policy`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute::fuzzing::auth_policy(data));
