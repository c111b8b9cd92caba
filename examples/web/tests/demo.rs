//! The demo page's runs, on native (lavapipe): the same code the page awaits.

#![cfg(not(target_arch = "wasm32"))]

use hesper_web::demo;

#[test]
fn the_demo_matches_its_references_and_refuses_bad_input() {
    let report = pollster::block_on(demo::run(5000, 4, 40, 8)).unwrap();
    assert!(report.ok, "{}", report.lines.join("\n"));
    assert_eq!(report.lines.len(), 5);
    assert!(demo::kernel_wgsl(3).unwrap().contains("let i_2 = "));
    let err = pollster::block_on(demo::run(5000, 0, 40, 8)).err().unwrap();
    assert_eq!(err, "unroll: expected 1 to 16, given 0");
    assert_eq!(
        demo::kernel_wgsl(17).unwrap_err(),
        "unroll: expected 1 to 16, given 17"
    );
}
