#!/bin/sh
# Wrap "VRAM Lab.app" in a compressed disk image with an Applications link (drag to install). macOS only:
#
#   python packaging/build.py --variant full     (makes dist/vramlab-<version>-macos-<arch>-full/VRAM Lab.app
#                                                 and runs this script when hdiutil exists)
#   sh packaging/macos/make_dmg.sh "dist/.../VRAM Lab.app" dist/vramlab-0.1.0-macos-arm64-full.dmg
#
# Uses create-dmg (brew install create-dmg) when installed, for a window with the icon layout; plain
# hdiutil otherwise. Neither signs nor notarizes: for distribution outside your machine, sign the .app
# first (codesign --deep --options runtime --sign "Developer ID Application: ..." "VRAM Lab.app"),
# then notarize the dmg (xcrun notarytool submit ... --wait; xcrun stapler staple <dmg>).
set -eu
app=${1:?usage: make_dmg.sh <VRAM Lab.app> <out.dmg>}
dmg=${2:?usage: make_dmg.sh <VRAM Lab.app> <out.dmg>}
[ -d "$app" ] || { echo "error: $app is not a folder" >&2; exit 1; }
rm -f "$dmg"
if command -v create-dmg >/dev/null 2>&1; then
    create-dmg --volname "VRAM Lab" --window-size 540 320 --icon-size 96 \
        --icon "$(basename "$app")" 140 150 --app-drop-link 400 150 "$dmg" "$app"
else
    stage=$(mktemp -d)
    trap 'rm -rf "$stage"' EXIT
    cp -R "$app" "$stage/"
    ln -s /Applications "$stage/Applications"
    hdiutil create -volname "VRAM Lab" -srcfolder "$stage" -fs HFS+ -format UDZO -ov "$dmg"
fi
echo "wrote $dmg"
