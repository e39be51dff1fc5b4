//! Fuzz target: see `kvroute::fuzzing::publish_events`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute::fuzzing::publish_events(data));
